"""The tendril-124m model (its real 50,304-token vocabulary and 1024 context) trained on CPU end to end.

Under torchrun, 2 gloo ranks with FSDP2 and selective activation checkpointing, fp32, micro batch 1 x 1024 per
rank, 2,048 tokens per step: 4 steps with a checkpoint at step 2 (the embedded corpus and its 4k BPE stand in for
FineWeb-Edu; the model keeps the recipe's vocabulary). Then the step-2 checkpoint resumes on 2 ranks (next losses
must be bit-equal) and on 1 rank (equal to 1e-5: the gradient sums run in another order), and the final checkpoint
is exported to a Hugging Face Llama folder whose logits must equal the model's. Reports wall time of each part, the
peak RSS of the largest rank (`getrusage(RUSAGE_CHILDREN)`) and the plan's per-rank tensor bytes for the same run.

    python bench/scale_124m.py [--work DIR]      # about 10-15 minutes on 2 busy cores; last stdout line is JSON
    python bench/scale_124m.py --smoke           # the same parts with the model at dim 64, 2 layers, 64-token context,
                                                 # the data prepared to 200k tokens
"""
from __future__ import annotations
import argparse, json, os, resource, subprocess, sys, tempfile, time
from pathlib import Path
from common import add_smoke, results_path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = "recipes/pretraining/tendril-124m.yaml"
GG = [sys.executable, "-m", "gradient_garden.cli"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "gradient_garden.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
STEPS = 4
# --smoke: appended to the overrides
SMOKE = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=4096",
         "model.max_seq_len=64", "training.seq_len=64", "training.total_batch_size=128"]

def run(cmd, timeout=3600) -> tuple[float, subprocess.CompletedProcess]:
    "Run `cmd` in the repository; raise with its output tail on failure; return (seconds, process)."
    t0 = time.perf_counter()
    r = subprocess.run([str(c) for c in cmd], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({r.returncode}):\n"
                           f"{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
    return time.perf_counter() - t0, r

def overrides(work: Path, runs: Path, smoke: bool = False) -> list[str]:
    "The recipe's model at CPU size of batch: fp32, FSDP2, selective checkpointing, 4 steps, checkpoint every 2."
    s = {"paths.datasets": work/"datasets", "tokenizer.path": work/"tokenizer", "paths.evals": work/"evals",
         "paths.runs": runs, "runtime.device": "cpu", "runtime.precision": "fp32", "runtime.compile": "false",
         "runtime.fsdp": "true",
         "runtime.activation_checkpointing": "selective", "training.micro_batch_size": 1, "training.seq_len": 1024,
         "training.total_batch_size": 2048, "training.max_steps": STEPS, "training.log_every": 1,
         "optimizers.adamw.warmup_steps": 1, "validation.enabled": "false", "evals.every": 0, "generation.every": 0,
         "checkpointing.every": 2, "checkpointing.keep_last": 3, "checkpointing.keep_best": "false"}
    return [f"{k}={v}" for k, v in s.items()] + (SMOKE if smoke else [])

def losses(runs: Path) -> dict:
    lines = (runs/"pretraining"/"tendril-124m"/"metrics.jsonl").read_text().splitlines()
    recs = [json.loads(l) for l in lines if l.strip()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}

def step_checkpoint(ckpt_dir: Path, step: int) -> Path:
    "The checkpoint of `step` in either layout: `step_N.pt` (one process) or the sharded `step_N/` (several ranks)."
    (found,) = [p for p in ckpt_dir.glob(f"step_{step:07d}*") if p.suffix == ".pt" or p.is_dir()]
    return found

def hf_logits_match(ckpt: Path, out: Path) -> float:
    "Export `ckpt` with `gg export` and return the max |logit difference| between the HF model and ours."
    import torch
    from transformers import AutoModelForCausalLM
    from gradient_garden.checkpoint.checkpoints import load_model_from_checkpoint
    run([*GG, "export", "--checkpoint", ckpt, "--out", out])
    ours, cfg = load_model_from_checkpoint(ckpt, "cpu", torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    toks = torch.randint(0, cfg.model.vocab_size, (1, min(256, cfg.model.max_seq_len)),
                         generator=torch.Generator().manual_seed(0))
    with torch.no_grad(): return float((ours.eval()(toks) - hf(toks).logits).abs().max())

def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default=None, help="working folder (default: a temporary one)")
    p.add_argument("--out", default=None, help="also write the JSON here (e.g. bench/results/scale_124m.json)")
    args = add_smoke(p).parse_args(argv)
    if args.smoke and args.out: args.out = str(results_path(args.out, True))
    work = Path(args.work or tempfile.mkdtemp(prefix="gg_scale_"))
    res = {"bench": "scale_124m", "smoke": args.smoke}
    base = [f"paths.datasets={work/'datasets'}", f"tokenizer.path={work/'tokenizer'}", f"paths.evals={work/'evals'}"]
    prepare = [*GG, "prepare", "--recipe", "recipes/pretraining/debug.yaml", "--no-progress", "--set", *base]
    res["prepare_s"], _ = run(prepare + (["data.target_tokens=200000", "data.val_fraction=0.1"] if args.smoke else []))
    sets = lambda runs: overrides(work, runs, args.smoke)
    res["train_2ranks_s"], _ = run([*TORCHRUN, "train", "--recipe", RECIPE, "--set", *sets(work/"full")])
    res["peak_rss_largest_rank_mib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    full = losses(work/"full")
    ckpt_dir = work/"full"/"pretraining"/"tendril-124m"/"checkpoints"
    mid = step_checkpoint(ckpt_dir, 2)   # sharded: 2 ranks write their own shards, resumed on 2 and on 1
    res["resume_2ranks_s"], _ = run([*TORCHRUN, "train", "--recipe", RECIPE, "--checkpoint", mid,
                                     "--set", *sets(work/"r2")])
    res["resume_1rank_s"], _ = run([*GG, "train", "--recipe", RECIPE, "--checkpoint", mid, "--set", *sets(work/"r1")])
    r2, r1 = losses(work/"r2"), losses(work/"r1")
    res["losses"] = dict(full=full, resumed_2ranks=r2, resumed_1rank=r1)
    res["resume_2ranks_equal"] = sorted(r2) == [3, 4] and all(r2[s] == full[s] for s in r2)
    res["resume_1rank_max_rel"] = max(abs(r1[s] - full[s]) / abs(full[s]) for s in (3, 4))
    t0 = time.perf_counter()
    res["hf_max_abs_logit_diff"] = hf_logits_match(step_checkpoint(ckpt_dir, STEPS), work/"hf")
    res["export_s"] = time.perf_counter() - t0
    sys.path.insert(0, str(ROOT))
    from gradient_garden.recipes import load_config
    from gradient_garden.train.plan import memory_plan
    cfg, _ = load_config(recipe=ROOT/RECIPE, overrides=sets(work/"full"), world_size=2)
    res["plan_per_rank_mib"] = memory_plan(cfg, "fsdp2", 2, device_type="cpu")["total"]["selective"] / 2**20
    res["tokens_per_s"] = STEPS * cfg.training.total_batch_size / res["train_2ranks_s"]
    print(json.dumps(res))
    if args.out: Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return res

if __name__ == "__main__":
    main()
