r"""Check `gg plan`'s memory model against measured peak memory of real CPU training steps.

For three model sizes (about 10M, 50M and the 124M recipe, at micro batch 2 x 1024 tokens, fp32, the recipe's Muon +
AdamW), with activation checkpointing `none` and `full`, in one process and on 2 FSDP2 ranks (gloo), one training
step is run to create the gradients and optimizer state, and then a second step (forward, backward onto the
existing gradients, optimizer step) is measured by `torch.distributed._tools` `MemTracker` / `FSDPMemTracker`, which
follow every tensor storage the step allocates. The peak total bytes (max over ranks) are compared with
`memory_plan(...)["total"][mode]`. Writes bench/results/plan_memory.json; the last stdout line is the same JSON.

With `--accum N` each step is the trainer's: gradients set to None, N micro-steps under `grad_sync` (FSDP2
accumulating as `--accumulation` says: `reduce_scatter`, the default, or `no_sync`, the behaviour before it), then
the optimizer; the rows go to bench/results/plan_memory_accum.json, both accumulation modes side by side, each with
the tracker's category breakdown at the peak and `peak_at`: the phase (micro-step forward or backward, optimizer step)
in which the peak was reached, and the innermost module running then.

    python bench/plan_memory.py               # all rows (about 10 minutes on 2 busy cores)
    python bench/plan_memory.py --sizes 10m   # one size
    python bench/plan_memory.py --accum 4 --worlds 2 --modes none --accumulation reduce_scatter,no_sync \
        --batch-size 1 --seq-len 512
    # the `tiny` size (dim 64, 2 layers), checkpointing none, 1 and 2 ranks, 1 x 64
    python bench/plan_memory.py --smoke
"""
from __future__ import annotations
import argparse, json, sys, tempfile, time
from pathlib import Path
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from gradient_garden.config import RuntimeConfig
from gradient_garden.recipes import load_recipe
from common import add_smoke, apply_smoke, results_path

SIZES = {  # overrides of the 124M recipe's model
    "10m": dict(dim=256, n_layers=6, n_heads=4, n_kv_heads=4, vocab_size=8192, tie_embeddings=False),
    "50m": dict(dim=512, n_layers=10, n_heads=8, n_kv_heads=4, vocab_size=32768, tie_embeddings=True),
    "124m": {},
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=1024, tie_embeddings=False),   # --smoke
}

def config(size: str, mode: str, batch: int, seq: int, accum: int = 1, world: int = 1,
           accumulation: str = "reduce_scatter"):
    "The 124M recipe at `size`: fp32 on CPU, micro batch `batch` x `seq`, `accum` micro-steps, checkpointing `mode`."
    cfg = load_recipe(ROOT/"recipes"/"pretraining"/"tendril-124m.yaml").config
    for k, v in SIZES[size].items(): setattr(cfg.model, k, v)
    cfg.runtime = RuntimeConfig(device="cpu", precision="fp32", fsdp=True, activation_checkpointing=mode,
                                fsdp_accumulation=accumulation)
    cfg.training.micro_batch_size, cfg.training.seq_len = batch, seq
    cfg.training.total_batch_size = batch * seq * accum * world
    # AdamW only: Muon's gathered matrices (not in this plan) peak in its step
    if accum > 1: cfg.optimizers.muon.enabled = False
    return cfg

def measured_peak(cfg, rank: int, world: int, accum: int = 1) -> dict:
    "Peak bytes of the second of two training steps on this rank (MemTracker, or FSDPMemTracker under FSDP2)."
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from gradient_garden.models.registry import build_model
    from gradient_garden.parallel.distributed import DistEnv, parallelize, grad_sync
    from gradient_garden.train.optim import build_optimizers
    torch.manual_seed(0)
    env = DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world)
    model = parallelize(build_model(cfg.model), cfg.runtime, env)
    opts = build_optimizers(model, cfg.optimizers, "cpu")
    t = cfg.training
    toks = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_len + 1),
                         generator=torch.Generator().manual_seed(rank))
    def step():
        (model(toks[:, :-1], labels=toks[:, 1:]) / toks[:, 1:].numel()).backward()
        for o in opts: o.step()
    live, where = [], {}       # the tracker while it runs; where its peak was reached (phase and innermost module)
    def mark(phase, reset=True):
        "Note `phase` (and the innermost module active then) when the tracker's peak rose during it."
        if not live: return
        tr = live[0]
        peak = tr.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        if peak > where.get("bytes", 0):
            mods = [(len(m.mod_fqn), m.mod_fqn) for m in tr.memory_tracking.values()
                    if m.local_peak.get(torch.device("cpu"), 0) == peak]
            where.update(bytes=peak, phase=phase, module=max(mods)[1] if mods else None)
        if reset: tr.reset_mod_stats()   # per-module stats per micro-step (the peak itself is kept)
    def accumulating_step():   # the trainer's step: fresh gradients, `accum` micro-steps, the optimizer
        for o in opts: o.zero_grad(set_to_none=True)
        for i in range(accum):
            with grad_sync(model, sync=i == accum - 1, fsdp_accumulation=cfg.runtime.fsdp_accumulation):
                loss = model(toks[:, :-1], labels=toks[:, 1:]) / toks[:, 1:].numel() / accum
                mark(f"micro-step {i} forward", reset=False)
                loss.backward(); del loss
                mark(f"micro-step {i} backward")
        for o in opts: o.step()
        mark("optimizer step")
    if accum > 1: step = accumulating_step
    step()                     # gradients and optimizer state now exist; the measured step accumulates onto them
    tracker = FSDPMemTracker(model, opts[0]) if world > 1 else MemTracker()
    tracker.track_external(model, *opts) if world == 1 else tracker.track_external(*opts[1:])
    t0 = time.perf_counter()
    live.append(tracker)
    with tracker: step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return dict(total=peak["Total"], seconds=time.perf_counter() - t0,
                breakdown={str(k).split(".")[-1]: round(v / 2**20, 1) for k, v in peak.items() if k != "Total"},
                peak_at={k: v for k, v in where.items() if k != "bytes"})

def _rank(rank, world, init, cfg, out, accum=1):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    res = measured_peak(cfg, rank, world, accum)
    Path(f"{out}.{rank}").write_text(json.dumps(res))
    dist.barrier(); dist.destroy_process_group()

def measure(cfg, world: int, accum: int = 1) -> dict:
    "Measured peak (max over ranks) on `world` ranks."
    if world == 1: return measured_peak(cfg, 0, 1, accum)
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_rank, args=(world, f"{d}/init", cfg, f"{d}/out", accum), nprocs=world, join=True)
        ranks = [json.loads(Path(f"{d}/out.{r}").read_text()) for r in range(world)]
    worst = max(ranks, key=lambda r: r["total"])
    return dict(total=worst["total"], seconds=max(r["seconds"] for r in ranks), breakdown=worst["breakdown"],
                peak_at=worst["peak_at"])

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="10m,50m,124m")
    p.add_argument("--modes", default="none,full")
    p.add_argument("--worlds", default="1,2")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--accumulation", default="reduce_scatter", help="FSDP2 accumulation modes, comma-separated")
    p.add_argument("--out", default=None)
    args = apply_smoke(add_smoke(p).parse_args(argv), sizes="tiny", modes="none", worlds="1,2", batch_size=1,
                       seq_len=64)
    name = "plan_memory.json" if args.accum == 1 else "plan_memory_accum.json"
    args.out = args.out or str(ROOT/"bench"/"results"/name)
    if args.smoke: args.out = str(results_path(args.out, True))
    from gradient_garden.train.plan import memory_plan, parameter_counts
    rows = []
    for size in args.sizes.split(","):
        for world in map(int, args.worlds.split(",")):
            for mode in args.modes.split(","):
                for acc in args.accumulation.split(","):
                    cfg = config(size, mode, args.batch_size, args.seq_len, args.accum, world, acc)
                    mp_ = memory_plan(cfg, "fsdp2" if world > 1 else "single", world, device_type="cpu")
                    plan = mp_["total"][mode]
                    got = measure(cfg, world, args.accum)
                    row = dict(size=size, parameters=parameter_counts(cfg)["total"], ranks=world,
                               activation_checkpointing=mode, measured_mib=round(got["total"] / 2**20, 1),
                               plan_mib=round(plan / 2**20, 1), plan_over_measured=round(plan / got["total"], 3),
                               step_s=round(got["seconds"], 1))
                    if args.accum > 1:
                        row |= dict(measured_breakdown_mib=got["breakdown"], peak_at=got["peak_at"], accumulation=acc,
                                    unsharded_gradients_mib=round(mp_["unsharded_gradients"] / 2**20, 1))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    res = dict(smoke=args.smoke, batch_size=args.batch_size, seq_len=args.seq_len, precision="fp32", rows=rows) | (
        dict(accum=args.accum) if args.accum > 1 else {})
    if args.sizes == "10m,50m,124m": Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res))

if __name__ == "__main__":
    main()
