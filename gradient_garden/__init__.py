"""A notebook-first, literate research platform for training language models

Modules (each exported from one notebook in `nbs/`; `nbs/index.ipynb` lists the notebooks in reading order):

- `gradient_garden.cli`: One console script with a verb per job: `prepare`, `train`, `notebook`, `evaluate`, `generate`, `export`, `serve`, `plan`.
- `gradient_garden.cli.__main__`: The package's `__main__`: `python -m gradient_garden.cli ARGS` runs `gg ARGS` (the tests and `torchrun` use it).
- `gradient_garden.cli.evaluate`: Validation loss, the multiple-choice benchmarks and any lm-evaluation-harness task of a checkpoint (or a Hugging Face folder), split across ranks under torchrun, written as one JSON file.
- `gradient_garden.cli.generate`: Two verbs that start from a checkpoint: complete prompts with it, or write it as a Hugging Face Llama folder.
- `gradient_garden.cli.prepare`: The command that tokenizes a stage's data into `<paths.datasets>/<stage>` and stores the eval sets in `paths.evals`: flags, config resolution, the choice of data section, and the lines it prints.
- `gradient_garden.cli.serve`: The verb: its flags, the checks made before anything loads (an API key off loopback, the port), the decoder's place
- `gradient_garden.config`: One nested, typed `GlobalConfig` for every run; recipes that bundle it with a data mix; dotted overrides; and errors that name the key path, the value and what is allowed.
- `gradient_garden.data.loaders`: Memory-mapped token shards served as (input, label) windows: shuffled by a seed, disjoint across ranks, resumable to the exact window, with validation batches that never change.
- `gradient_garden.data.prepare`: Sources, weighted mixes and a streaming tokenizer that writes train/val token shards: resumable, memory-bounded, stamped with the tokenizer that made them.
- `gradient_garden.data.verifiable`: Small tasks with known answers — arithmetic, spelling, reversal, string edits — generated on the spot, with a held-out split, an exact-match scorer, and preference pairs (correct vs corrupted answer).
- `gradient_garden.engine.activation_checkpointing`: Recompute each block's activations in the backward pass instead of keeping them: `none`, `full` (every block) or `selective` (keep the matmul and attention outputs, recompute the cheap rest), applied to a plain model from the outside, as FSDP2 is.
- `gradient_garden.engine.checkpoints`: One file, or one directory of per-rank shards, per checkpoint, written atomically, read back without unpickling code; resharding to any number of ranks; asynchronous saves; retention of the last N and the best; RNG states; and errors that say what is wrong with a checkpoint instead of a traceback from torch.
- `gradient_garden.engine.distributed`: Start from the torchrun environment (or fall back to one process), pick the device and backend, and apply data parallelism to a model from the outside: DDP, or FSDP2's `fully_shard` per block and on the root.
- `gradient_garden.engine.optim`: Which parameters get weight decay, which get Muon, and a Muon that matches `torch.optim.Muon` step for step while also working on FSDP2-sharded (DTensor) parameters.
- `gradient_garden.engine.plan`: `plan(cfg, gpu=..., gpus_per_node=..., nodes=...)` answers before anything is allocated: per-rank memory for parameters, gradients, optimizer state and activations (with and without activation checkpointing) under one process, DDP, FSDP2 and HSDP; FLOPs per token; the token budget against Chinchilla; steps; and wall time at a stated or measured MFU. `gg plan` prints it and `gg train` runs the same fit check first.
- `gradient_garden.engine.run`: From a resolved config to a finished run: process group, tokenizer, model (from scratch or a checkpoint), LoRA, parallelism, the stage's task and loaders, the trainer, and the run directory's files.
- `gradient_garden.engine.schedules`: Pure functions from the step number to a learning rate: linear warmup, then cosine decay, or warmup-stable-decay with a linear, cosine or 1-sqrt cool-down.
- `gradient_garden.engine.telemetry`: What a run records and shows: the snapshot of what ran, metrics as JSON lines and W&B, the profiler, the progress line and the end-of-stage summary table.
- `gradient_garden.engine.trainer`: One loop for every stage: gradient accumulation from a token budget, an exact mean over supervised tokens, mixed precision, clipping, validation on fixed batches, early stopping, generation and evals during training, and checkpoints that resume exactly.
- `gradient_garden.eval_data`: HellaSwag, WinoGrande and ARC-Challenge as lm-evaluation-harness reads them: each hub row turned into (context, continuation) pairs and a gold index, loaded and checked from local JSON lines, and `gg prepare`'s copy.
- `gradient_garden.evals`: HellaSwag, WinoGrande and ARC-Challenge scored the way lm-evaluation-harness scores them, in batches, split across ranks, for `gg evaluate` and for evals during training; the rows they score are `21_eval_data`'s.
- `gradient_garden.generation`: Greedy, temperature, top-k and top-p sampling with a repetition penalty; batches of prompts of different lengths decoded together with left padding and a preallocated KV cache; stop tokens; a lean one-token decoding step for CPU; and `gg generate`.
- `gradient_garden.hardware`: What a device can do: the dense datasheet peak of known GPUs, a measured matmul peak elsewhere, and the precision the matmuls actually run in.
- `gradient_garden.lm_eval_model`: The platform's model registered with lm-evaluation-harness: `loglikelihood`, `loglikelihood_rolling` and `generate_until` on a native checkpoint, batched, with the platform's KV-cache generation.
- `gradient_garden.models.attention`: Rotary position embeddings from precomputed tables, grouped-query attention on PyTorch's fused SDPA kernels (without copying the shared K/V heads where the kernel allows), causal / padding / packed-document masks, and a preallocated KV cache for decoding.
- `gradient_garden.models.hf`: Export a Tendril as a Hugging Face Llama folder (`config.json`, safetensors weights, tokenizer files) that `transformers` loads as is, and import such a folder back into a Tendril; refuse what has no Llama equivalent.
- `gradient_garden.models.lora`: Train a few million adapter weights instead of the whole model: `apply_lora`, `merge_lora` / `unmerge_lora`, and adapter-only state dicts.
- `gradient_garden.models.moe`: A Tendril whose feed-forward is a set of SwiGLU experts picked per token by a learned top-k router, with the load-balancing and z-losses that keep the router healthy, sort-and-grouped-matmul dispatch, an optional shared expert, an optional capacity limit, and the router statistics a run reports.
- `gradient_garden.models.tendril`: RMSNorm, the SwiGLU feed-forward, the training loss computed without materialising the logits, pre-norm blocks, optional tied embeddings, the initialisation, a model registry that lets a new architecture plug in by name, and the parameter / FLOP counts the trainer reports.
- `gradient_garden.runtime`: The names of dtypes, the choice of device, the autocast context of mixed precision, and files written so that a crash leaves the old file or the new one, never half of either: one definition each, for every layer above.
- `gradient_garden.serve`: `gradient_garden.serve` was one module until it became a package; the names people may have imported from it keep
- `gradient_garden.serve.api`: The OpenAI request bodies as strict pydantic models, OpenAI-style errors, and a request turned into the prompts
- `gradient_garden.serve.app`: A request run on the event loop with one wake-up per decoding step, streams coalesced by a stream interval, SSE
- `gradient_garden.serve.decoder`: `BatchDecoder`: continuous batching. One KV cache for every running request, new requests prefilled together and
- `gradient_garden.serve.process`: A checkpoint loaded into a `BatchDecoder`, and that decoder in a process of its own, spoken to over two pipes
- `gradient_garden.serve.streams`: Token ids in, text out one piece at a time: whole characters only, and stop strings cut exactly, even across tokens.
- `gradient_garden.tasks.distillation`: A frozen `AutoModelForCausalLM` teacher, forward KL at temperature $T$ (scaled by $T^2$) mixed with cross-entropy, vocabulary checks, and a task that wraps the causal (pretraining or SFT) task.
- `gradient_garden.tasks.dpo`: Preference pairs (prompt, chosen, rejected), a frozen reference, the sigmoid / IPO / conservative DPO losses, their reward metrics, a resumable pair loader, the `dpo` stage, and preference accuracy.
- `gradient_garden.tasks.pretraining`: The causal language-modelling stage: next-token cross-entropy over token shards, registered as the `pretraining` stage.
- `gradient_garden.tasks.rl`: GRPO-family policy optimisation on prompts whose answers can be checked: G completions per prompt sampled by our own KV-cache decoder (the prompt prefilled once per group), group-relative advantages, a clipped token-level loss with the `grpo`, `dr_grpo` and `dapo` normalisations, an optional k3 KL to the starting model, and the `rl` stage.
- `gradient_garden.tasks.sft`: Chat conversations -> token ids with a supervision mask, truncation at whole turns, packing with document masking (or padding), a resumable loader, the `instruct` stage, and exact-match evaluation on held-out tasks.
- `gradient_garden.tasks.stages`: `StageParts`: the task, the loaders and the final evaluation that a training stage (pretraining, instruct, DPO, or a plugin's) hands to the engine; and the plumbing the stages share: chat messages, ragged arrays on disk, data sources, and one rank's resumable position in a split's stream.
- `gradient_garden.tokenizer`: One `Tokenizer` interface over two backends — Hugging Face `tokenizers` and `tiktoken` — with the Llama 3 chat/control tokens, a chat renderer that says which tokens to train on, and a small BPE trained locally that both backends read.

Modules:

- `gradient_garden.engine.trainer`: One loop for every stage: gradient accumulation from a token budget, an exact mean over supervised tokens, mixed precision, clipping, validation on fixed batches, early stopping, generation and evals during training, and checkpoints that resume exactly. What a run records and shows (metrics, W&B, the profiler, the progress line, the summary table) is `45_telemetry`; the peaks MFU is quoted against are `06_hardware`."""

__version__ = "0.1.0"
