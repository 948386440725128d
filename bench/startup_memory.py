"""Peak host memory per rank building the 124M model under 2-rank FSDP2 (gloo, CPU): today's start vs a meta-device one.

`whole`: every rank builds and initialises the whole fp32 model on its CPU, then FSDP2 shards it (the start before
the meta device). `meta`: every rank builds the model on the meta device, FSDP2 shards it there, and
`materialize` gives the rank storage for its own shards only and initialises them block by block (`22_distributed`).
Each mode runs in fresh processes; a rank measures its resident set (`VmRSS`) after imports and the process group,
resets the kernel's high-water mark (`/proc/self/clear_refs`), builds, and reports `VmHWM` minus that baseline: the
host memory the start itself took (tracemalloc would see none of it: torch allocates outside Python's allocator).
Writes bench/results/startup_memory.json; the last stdout line is the same JSON.

    python bench/startup_memory.py
    # the model shrunk to dim 64, 2 layers; the JSON goes to a temporary folder
    python bench/startup_memory.py --smoke
"""
from __future__ import annotations
import argparse, json, sys, tempfile, time
from pathlib import Path
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from common import add_smoke, results_path
TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=1024)

def _status(key: str) -> int:
    "A `/proc/self/status` figure in bytes (VmRSS, VmHWM)."
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024

def _rank(rank, world, init, mode, out, smoke=False):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    from gradient_garden.config import RuntimeConfig
    from gradient_garden.recipes import load_recipe
    from gradient_garden.models.registry import build_model
    from gradient_garden.parallel.distributed import DistEnv, parallelize
    cfg = load_recipe(ROOT/"recipes"/"pretraining"/"tendril-124m.yaml").config
    if smoke:
        for k, v in TINY.items(): setattr(cfg.model, k, v)
    runtime = RuntimeConfig(device="cpu", precision="fp32", fsdp=True)
    env = DistEnv(rank, rank, world, torch.device("cpu"), "gloo", world)
    dist.barrier()
    base = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")   # VmHWM := VmRSS
    t0 = time.perf_counter()
    if mode == "whole":
        torch.manual_seed(0)
        model = parallelize(build_model(cfg.model), runtime, env)
    else:
        with torch.device("meta"): model = build_model(cfg.model)
        model = parallelize(model, runtime, env, init_seed=0)
    seconds = time.perf_counter() - t0
    local = sum(p.to_local().numel() * 4 for p in model.parameters())
    Path(f"{out}.{rank}").write_text(json.dumps(dict(peak=_status("VmHWM") - base, after=_status("VmRSS") - base,
                                                     shards=local, seconds=seconds)))
    dist.barrier(); dist.destroy_process_group()

def measure(mode: str, world: int = 2, smoke: bool = False) -> dict:
    "Worst rank's figures for one start-up `mode`."
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_rank, args=(world, f"{d}/init", mode, f"{d}/out", smoke), nprocs=world, join=True)
        ranks = [json.loads(Path(f"{d}/out.{r}").read_text()) for r in range(world)]
    return {k: max(r[k] for r in ranks) for k in ranks[0]}

def main(argv=None):
    args = add_smoke(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args(argv)
    mib = lambda b: round(b / 2**20, 1)
    res = {mode: measure(mode, smoke=args.smoke) for mode in ("whole", "meta")}
    out = dict(bench="startup_memory", smoke=args.smoke,
               model="tendril-124m" + (" (dim 64, 2 layers)" if args.smoke else ""), ranks=2,
               **{f"{m}_{k}_mib": mib(v) for m, r in res.items() for k, v in r.items() if k != "seconds"},
               **{f"{m}_seconds": round(r["seconds"], 2) for m, r in res.items()})
    out["peak_ratio"] = round(res["meta"]["peak"] / res["whole"]["peak"], 3) if res["whole"]["peak"] else None
    for m in res:
        print(f"{m:6s} peak {mib(res[m]['peak']):8.1f} MiB above the baseline, "
              f"shards {mib(res[m]['shards']):7.1f} MiB, {res[m]['seconds']:.1f} s")
    print(f"meta / whole peak: {out['peak_ratio']}")
    results_path(ROOT/"bench"/"results"/"startup_memory.json", args.smoke).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))

if __name__ == "__main__":
    main()
