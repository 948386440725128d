"""A notebook-first, literate research platform for training language models

Modules (each exported from one notebook in `nbs/`; `nbs/index.ipynb` lists the notebooks in reading order):

- `gradient_garden.batching`: `Decoder`: continuous batching, the one decoder that `generate`, serving and RL rollouts
  share. One KV cache,
- `gradient_garden.checkpoint.checkpoints`: One file, or one directory of per-rank shards, per checkpoint, written
  atomically, read back without unpickling
- `gradient_garden.checkpoint.dcp_files`: Reading a `torch.distributed.checkpoint` directory without unpickling code,
  checking its shard files before dcp
- `gradient_garden.checkpoint.hf`: Write a Tendril as a Hugging Face folder of its family, Llama, Mistral, Qwen2 or
  Qwen3 (`config.json`,
- `gradient_garden.checkpoint.state_dict`: One adapter between a model's own state dict (q/k/v stored as one `wqkv`,
  gate/up as one `w13`), the layout
- `gradient_garden.checks`: The values that parse but cannot be right: ranges (NaN and infinity included) and
  combinations of keys, each
- `gradient_garden.cli`: One console script with a verb per job: `prepare`, `train`, `notebook`, `evaluate`, `generate`,
  `export`, `serve`,
- `gradient_garden.cli.__main__`: The package's `__main__`: `python -m gradient_garden.cli ARGS` runs `gg ARGS` (the
  tests and `torchrun` use it).
- `gradient_garden.cli.common`: What every `gg` verb shares: the note a failing worker leaves for torchrun.
- `gradient_garden.cli.evaluate`: Validation loss, the multiple-choice benchmarks and any lm-evaluation-harness task of
  a checkpoint (or a Hugging
- `gradient_garden.cli.generate`: Two verbs that start from a checkpoint: complete prompts with it, or write it as a
  Hugging Face Llama folder.
- `gradient_garden.cli.launch`: torchrun's launcher, run by `gg` itself: the same flags and workers, and a last line of
  ours when the launcher is
- `gradient_garden.cli.prepare`: The command that tokenizes a stage's data into `<paths.datasets>/<stage>` and stores
  the eval sets in `paths.evals`:
- `gradient_garden.cli.serve`: The verb: its flags, the checks made before anything loads (an API key off loopback, the
  port), the decoder's place
- `gradient_garden.cli.train`: The verbs that take a recipe: train it, train it through the papermill report notebook,
  or plan it (memory,
- `gradient_garden.config`: One nested, typed `GlobalConfig` for every run, built strictly from plain data, with errors
  that name the key path,
- `gradient_garden.data.loaders`: Memory-mapped token shards served as (input, label) windows: shuffled by a seed,
  disjoint across ranks, resumable
- `gradient_garden.data.prepare`: Sources, weighted mixes and a streaming tokenizer that writes train/val token shards:
  resumable, memory-bounded,
- `gradient_garden.data.verifiable`: Small tasks with known answers — arithmetic, spelling, reversal, string edits —
  generated on the spot, with dev
- `gradient_garden.evals.benchmarks`: HellaSwag, WinoGrande and ARC-Challenge as lm-evaluation-harness reads them: each
  hub row turned into
- `gradient_garden.evals.environments`: Multi-turn environments for RL (model turn, environment turn, reward), a
  calculator tool task, and rollouts.
- `gradient_garden.evals.generative`: Greedy exact match, pass@k and avg@k of a model's own answers, checked by the
  verifiers, each with its standard
- `gradient_garden.evals.lm_eval`: The platform's model registered with lm-evaluation-harness: `loglikelihood`,
  `loglikelihood_rolling` and
- `gradient_garden.evals.multiple_choice`: HellaSwag, WinoGrande and ARC-Challenge scored the way lm-evaluation-harness
  scores them, in batches, split
- `gradient_garden.evals.verifiers`: What says whether a generated answer is right: the embedded tasks' exact match,
  GSM8K's one final answer, a
- `gradient_garden.generation`: Greedy, temperature, top-k and top-p sampling with a repetition penalty; a lean
  one-token decoding step over a KV
- `gradient_garden.hardware`: What a device can do: the dense datasheet peak of known GPUs, a measured matmul peak
  elsewhere, and the precision
- `gradient_garden.models.attention`: Rotary position embeddings from precomputed tables, grouped-query attention on
  PyTorch's fused SDPA kernels
- `gradient_garden.models.float8`: float8 matmuls in a model's Linear layers with torchao (tensorwise or rowwise
  scaling), applied from outside.
- `gradient_garden.models.hf`: Translate a Tendril config to the `transformers` config of the same model (`LlamaConfig`,
  `MistralConfig`,
- `gradient_garden.models.lora`: Train a few million adapter weights instead of the whole model: `apply_lora`,
  `merge_lora` / `unmerge_lora`,
- `gradient_garden.models.moe`: A Tendril whose feed-forward is a set of SwiGLU experts picked per token by a learned
  top-k router, with the
- `gradient_garden.models.registry`: One table from a model's `architecture` name to its class and its FLOP count: the
  built-in Tendril and
- `gradient_garden.models.tendril`: RMSNorm, the SwiGLU feed-forward, the training loss computed without materialising
  the logits, pre-norm blocks,
- `gradient_garden.parallel.activation_checkpointing`: Recompute each block's activations in the backward pass instead
  of keeping them: `none`, `full` (every block) or
- `gradient_garden.parallel.collectives`: The collectives that the layers above use (`all_reduce`, `barrier`,
  `broadcast_object`, `all_gather_objects`),
- `gradient_garden.parallel.distributed`: Start from the torchrun environment (or fall back to one process), pick the
  device and backend, and apply data
- `gradient_garden.parallel.expert_parallel`: TendrilMoE's experts spread over ranks; tokens reach their experts and
  return by all-to-all.
- `gradient_garden.parallel.fault_tolerance`: Replica groups that keep training when one of them dies (torchft), and a
  restarted one that heals from a live peer.
- `gradient_garden.parallel.tensor_parallel`: Tensor and sequence parallelism with a DTensor plan per model, composed
  with FSDP2 on a 2-D `(dp, tp)` mesh.
- `gradient_garden.recipes`: Recipes that bundle a `GlobalConfig` with a data mix; dotted `--set` overrides; the
  resolved config every run keeps;
- `gradient_garden.runtime`: The names of dtypes, the choice of device, the autocast context of mixed precision, and
  files written so that a
- `gradient_garden.serve.api`: The OpenAI request bodies as strict pydantic models, OpenAI-style errors, and a request
  turned into the prompts
- `gradient_garden.serve.app`: A request run on the event loop with one wake-up per decoding step, streams coalesced by
  a stream interval, SSE
- `gradient_garden.serve.decoder`: `BatchDecoder`: the server's `Decoder` (`30a_batching`), with a bounded queue fed
  from the web server's threads,
- `gradient_garden.serve.process`: A checkpoint loaded into a `BatchDecoder`, and that decoder in a process of its own,
  spoken to over two pipes
- `gradient_garden.serve.streams`: Token ids in, text out one piece at a time: whole characters only, and stop strings
  cut exactly, even across
- `gradient_garden.stages.base`: `Stage`: everything the platform knows of a training stage, in one spec; `StageParts`:
  the task, the loaders and the
- `gradient_garden.stages.distillation`: A frozen `AutoModelForCausalLM` teacher, forward KL at temperature $T$ (scaled
  by $T^2$) mixed with cross-entropy,
- `gradient_garden.stages.dpo`: Preference pairs (prompt, chosen, rejected), a frozen reference, the sigmoid / IPO /
  conservative DPO losses,
- `gradient_garden.stages.grpo`: Group-relative advantages and a clipped token-level loss with the `grpo`, `dr_grpo` and
  `dapo` normalisations, an
- `gradient_garden.stages.pretraining`: The causal language-modelling stage: next-token cross-entropy over token shards,
  registered as the
- `gradient_garden.stages.registry`: One table from a stage's name to its `Stage` spec: the built-in stages, the ones a
  plugin registers, and a stage
- `gradient_garden.stages.rewards`: The prompts of the RL stage and the reward of an answer: the verifier's judgement,
  an optional format reward, a
- `gradient_garden.stages.rl`: Reinforcement learning with verifiable rewards: the task that trains on the loader's
  rollout batches, held-out
- `gradient_garden.stages.rl_rollouts`: The RL stage's loader: G answers per prompt sampled from the current weights,
  scored and cut into the trainer's
- `gradient_garden.stages.sft`: Chat conversations -> token ids with a supervision mask, truncation at whole turns,
  packing with document
- `gradient_garden.tokenizer`: One `Tokenizer` interface over two backends — Hugging Face `tokenizers` and `tiktoken` —
  with the Llama 3
- `gradient_garden.train.optim`: Which parameters get weight decay, which get Muon, and a Muon that matches
  `torch.optim.Muon` step for step
- `gradient_garden.train.plan`: `plan(cfg, gpu=..., gpus_per_node=..., nodes=...)` answers before anything is allocated:
  per-rank memory for
- `gradient_garden.train.resume`: The state of a training run (its counters, early stopping, seeds) and what a
  checkpoint carries of it, so that a
- `gradient_garden.train.run`: From a resolved config to a finished run: process group, tokenizer, model (from scratch
  or a checkpoint), LoRA,
- `gradient_garden.train.schedules`: Pure functions from the step number to a learning rate: linear warmup, then cosine
  decay, or warmup-stable-decay
- `gradient_garden.train.telemetry`: What a run records and shows: the snapshot of what ran, metrics as JSON lines and
  W&B, the profiler, the progress
- `gradient_garden.train.trainer`: One loop for every stage: gradient accumulation from a token budget, an exact mean
  over supervised tokens,"""

__version__ = "0.1.0"
