"""The trainer runs that `test_sharded_checkpoints.py` and `test_hsdp.py` check, made once per session: every spawned
gloo world runs several jobs in turn (all ranks take part in each), so the whole matrix — resharding 1/2/4 ranks,
HSDP 2 x 2 parity and resume, DPO and distillation on 2 x 2, SFT resharded 2 -> 1 — costs three spawned worlds. A job
is `(name, overrides, checkpoint)`."""
import json, shutil
from pathlib import Path
from conftest import ROOT
from gloo_ranks import run_ranks

RECIPE = str(ROOT/"recipes"/"pretraining"/"debug.yaml")
STEPS = 10
FSDP = {"runtime.fsdp": "true"}
HSDP = {"runtime.fsdp": "true", "runtime.replicate": 2, "runtime.shard": 2}
MUON = {"optimizers.muon.enabled": "true"}
MOE = {"model.architecture": "tendril_moe", "model.n_experts": 4, "model.n_experts_per_token": 2,
       "training.max_steps": 4}
LORA = {"lora.enabled": "true", "lora.rank": 4, "training.max_steps": 4}
EVALS = {"evals.every": 5, "evals.hellaswag": "true", "evals.hellaswag_examples": 5, "evals.winogrande": "false",
         "evals.arc_challenge": "false", "evals.batch_size": 2, "generation.every": 5, "generation.max_gen_len": 4}

def sets(prepared, out: Path, **extra) -> list[str]:
    """A small Tendril, micro-batches of 4 x 64 tokens and 1024 tokens per step (4 micro-steps on 1 rank, 2 on 2, 1 on
    4: the same global batch on every world size), fp32, sharded checkpoints every 2 steps (all kept), under `out`."""
    s = {"paths.runs": out/"runs", "training.max_steps": STEPS, "training.log_every": 1, "model.dim": 64,
         "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2, "model.max_seq_len": 64,
         "training.seq_len": 64,
         "training.micro_batch_size": 4, "training.total_batch_size": 1024, "validation.every": 4,
         "validation.steps": 1,
         "generation.every": 0, "checkpointing.every": 2, "checkpointing.keep_last": 10,
         "checkpointing.format": "sharded",
         "optimizers.adamw.warmup_steps": 2, "runtime.device": "cpu", "runtime.precision": "fp32", **extra}
    return prepared["sets"] + [f"{k}={v}" for k, v in s.items()]

def run_dir(out: Path, stage: str = "pretraining") -> Path: return out/"runs"/stage/"debug"
def ckpts(out: Path, stage: str = "pretraining") -> Path: return run_dir(out, stage)/"checkpoints"

def losses(out: Path, stage: str = "pretraining") -> dict:
    "step -> training loss of the run under `out`."
    recs = [json.loads(l) for l in (run_dir(out, stage)/"metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}

def post_training_inputs(prepared, base: Path) -> dict:
    """Short verifiable chats and preference pairs prepared with the session's tokenizer (64-token context), and a tiny
    random Llama teacher with the same vocabulary; returns the overrides that point the post-training runs at them."""
    from transformers import LlamaConfig, LlamaForCausalLM
    import torch
    from gradient_garden.recipes import load_config
    from gradient_garden.stages.dpo import prepare_dpo
    from gradient_garden.stages.sft import prepare_instruct
    cfg, _ = load_config(recipe=RECIPE, overrides=sets(prepared, base/"unused"))
    src = {"type": "verifiable", "train": 160, "val": 16, "max_turns": 1, "seed": 0}
    prepare_instruct({"sources": [src]}, cfg, base/"datasets"/"instruct", progress=False)
    prepare_dpo({"sources": [{"type": "verifiable", "train": 160, "val": 16, "seed": 1}]}, cfg, base/"datasets"/"dpo",
                progress=False)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=cfg.model.vocab_size, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=64)).save_pretrained(base/"teacher")
    shutil.copytree(cfg.tokenizer.path, base/"teacher", dirs_exist_ok=True)  # it shares the student's tokenizer
    return {"paths.datasets": base/"datasets", "distillation.teacher": base/"teacher"}

def train(overrides: list[str], checkpoint=None, world: int = 1):
    "One run of the trainer in this process (or on this rank of a spawned world)."
    from gradient_garden.recipes import load_config
    from gradient_garden.train.run import run_training
    cfg, _ = load_config(recipe=RECIPE, overrides=overrides, world_size=world)
    return run_training(cfg, checkpoint=checkpoint)

def probe_mesh(out: Path):
    "Write where an HSDP-wrapped Tendril's parameters live (mesh shape, dim names, placements) to `out` (rank 0)."
    import torch.distributed as dist
    from gradient_garden.config import ModelConfig, RuntimeConfig
    from gradient_garden.parallel.distributed import init_distributed, parallelize
    from gradient_garden.models.registry import build_model
    runtime = RuntimeConfig(device="cpu", fsdp=True, replicate=2, shard=2)
    env = init_distributed(runtime)
    m = parallelize(build_model(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                                            max_seq_len=32)), runtime, env)
    w = m.layers[0].attention.wqkv.weight
    if env.is_main:
        out.write_text(json.dumps(dict(shape=list(w.device_mesh.shape), names=list(w.device_mesh.mesh_dim_names),
                                       placements=[str(p) for p in w.placements], local=list(w.to_local().shape))))
    dist.barrier()

def _world(rank, world, jobs):
    "Rank body: run each job in turn."
    for job in jobs:
        if job[0] == "probe": probe_mesh(job[1])
        else: train(job[1], job[2], world)

_RUNS: dict = {}

def all_runs(prepared, tmp_path_factory) -> Path:
    "Make every run once per session; returns the folder holding one sub-folder per run name."
    key = str(prepared["base"])
    if key in _RUNS: return _RUNS[key]
    base = tmp_path_factory.mktemp("trainer_worlds")
    S = lambda name, **kw: sets(prepared, base/name, **kw)
    c = lambda name, step: ckpts(base/name)/f"step_{step:07d}"
    train(S("one"))                                               # 1 process, AdamW: the reference
    train(S("one_muon", **MUON, **{"checkpointing.every": 0}))
    train(S("one_moe", **MOE, **{"checkpointing.every": 0}))
    train(S("one_lora", **LORA, **{"checkpointing.every": 0}))
    post = post_training_inputs(prepared, base/"post")
    DPO = {**post, "training.stage": "dpo", "training.max_steps": 4, "checkpointing.every": 0, "validation.every": 2}
    SFT = {**post, "training.stage": "instruct", "training.max_steps": 4, "validation.every": 2}
    DISTILL = {**SFT, "distillation.enabled": "true", "checkpointing.every": 0}
    train(S("one_dpo", **DPO)); train(S("one_distill", **DISTILL)); train(S("one_sft", **SFT))
    run_ranks(_world, 2, base/"init2", [
        ("two", S("two", **FSDP, **{"checkpointing.async_save": "true"}), None),   # 2 ranks, background saves
        ("one_two", S("one_two", **FSDP), c("one", 2)),                             # 1 -> 2
        ("two_sft", S("two_sft", **FSDP, **SFT), None)])                           # SFT on 2 ranks, for 2 -> 1
    run_ranks(_world, 4, base/"init4", [
        ("probe", base/"mesh.json"),
        ("two_four", S("two_four", **FSDP), c("two", 4)),                           # 2 -> 4
        ("hsdp", S("hsdp", **HSDP, **EVALS), None),                                 # 2 x 2 HSDP, evals and samples
        ("hsdp_hsdp", S("hsdp_hsdp", **HSDP), c("hsdp", 4)),                        # 2 x 2 -> 2 x 2
        ("hsdp_muon", S("hsdp_muon", **HSDP, **MUON, **{"checkpointing.every": 0}), None),
        ("hsdp_moe", S("hsdp_moe", **HSDP, **MOE, **{"checkpointing.every": 0}), None),
        ("hsdp_lora", S("hsdp_lora", **HSDP, **LORA, **{"checkpointing.every": 0}), None),
        ("hsdp_dpo", S("hsdp_dpo", **HSDP, **DPO), None),                           # precomputed reference on 2 x 2
        ("hsdp_distill", S("hsdp_distill", **HSDP, **DISTILL), None)])              # a replicated frozen teacher
    run_ranks(_world, 2, base/"init2b", [
        ("four_two", S("four_two", **FSDP), c("two_four", 6)),                      # 4 -> 2
        ("two_two", S("two_two", **FSDP), c("two", 4))])                            # 2 -> 2
    train(S("two_one"), c("two", 4))                                               # 2 -> 1
    train(S("hsdp_one"), c("hsdp", 4))                                             # 2 x 2 -> 1
    train(S("two_one_sft", **SFT), ckpts(base/"two_sft", "instruct")/"step_0000002")  # SFT 2 -> 1
    _RUNS[key] = base
    return base
