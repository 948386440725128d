"""How long training is blocked per checkpoint save, and rank 0's peak host memory: the full-state file vs sharded
(torch.distributed.checkpoint) synchronous vs sharded asynchronous saves, and the time to load each back.

The launcher starts `--ranks` CPU processes (gloo) under torchrun. Each builds the same Tendril (default ~134M
parameters: dim 768, 12 layers, 32k vocabulary), shards it with FSDP2 and takes one AdamW step so the optimizer state
exists (parameters + two moments: ~1.6 GB in all). Then, `--rounds` times and interleaved so machine load hits every
contender alike, it saves with the platform's own code paths:

- `full`: `resume.full_state` gathers the whole model and optimizer state to rank 0's CPU (what
  `checkpointing.format: full` does), rank 0 writes one `.pt` with `CheckpointManager.save` (fsync + rename); every
  rank waits at a barrier;
- `sharded`: `CheckpointManager.save_sharded` (every rank writes its own shards, fsynced; rank 0 commits);
- `async`: the same with `async_save=True`: training is blocked only until the shards are staged in host memory;
  the background write's own duration is reported too (and waited for before the next contender starts).

Blocked time is wall-clock seconds on rank 0 from the call to its return (all ranks return together: each contender
ends in a collective). Peak memory is rank 0's resident set sampled every millisecond by a thread from before the
save until the save (for `async`: the background write) has finished, minus the resident set just before: the extra
host memory a save needs. Load: `load_checkpoint` + `load_full_state` for the file, `load_sharded_state` for a
sharded directory, into the same FSDP2 model and optimizer. Timings are medians over rounds.

    python bench/checkpoint.py                      # 2 CPU ranks, ~134M parameters
    python bench/checkpoint.py --set model.dim=256 model.n_layers=4 --rounds 1   # quick
    python bench/checkpoint.py --smoke              # dim 64, 2 layers, vocabulary 1024, one round: seconds

The last line of stdout is one JSON object with the figures.
"""
from __future__ import annotations
import argparse, ctypes, gc, json, os, shutil, statistics, subprocess, sys, tempfile, threading, time
from pathlib import Path
import torch
import torch.nn.functional as F
from common import add_smoke

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=1024"]
MODEL = ["model.dim=768", "model.n_layers=12", "model.n_heads=12", "model.n_kv_heads=4", "model.vocab_size=32000",
         "model.max_seq_len=64", "training.seq_len=32", "training.micro_batch_size=1", "training.total_batch_size=64"]

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary folder)")
    p.add_argument("--set", nargs="*", default=[], dest="overrides", help="config overrides after the default model")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = add_smoke(p).parse_args(argv)
    if args.smoke and not args.worker: args.rounds, args.overrides = 1, TINY + args.overrides
    return args

class PeakRSS:
    "Samples this process's resident set every millisecond in a thread; `peak - base` is the extra memory used."
    def __init__(self):
        import psutil
        self.proc, self.peak, self.stop = psutil.Process(), 0, threading.Event()
    def __enter__(self):
        self.base = self.peak = self.proc.memory_info().rss
        self.thread = threading.Thread(target=self._run, daemon=True); self.thread.start()
        return self
    def _run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss); time.sleep(0.001)
    def __exit__(self, *exc):
        self.stop.set(); self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
    @property
    def extra(self) -> int: return self.peak - self.base

def release_memory():
    "Return freed heap to the OS between contenders, so each one's baseline is its own."
    gc.collect()
    try: ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError: pass

def worker(args):
    from gradient_garden.config import RuntimeConfig
    from gradient_garden.recipes import load_config
    from gradient_garden.parallel.collectives import all_gather_objects, barrier
    from gradient_garden.parallel.distributed import init_distributed, parallelize, destroy_distributed
    from gradient_garden.train.optim import build_optimizers
    from gradient_garden.checkpoint.checkpoints import (CheckpointManager, load_checkpoint, sharded_state,
                                                    load_sharded_state)
    from gradient_garden.train.resume import full_state, load_full_state
    from gradient_garden.models.tendril import count_parameters
    from gradient_garden.models.registry import build_model
    torch.set_num_threads(1)
    env = init_distributed(RuntimeConfig(device="cpu"))
    cfg, _ = load_config(recipe=str(ROOT/"recipes"/"pretraining"/"debug.yaml"), overrides=MODEL + args.overrides)
    torch.manual_seed(0)
    model = parallelize(build_model(cfg.model), RuntimeConfig(device="cpu", fsdp=True), env)
    opts = build_optimizers(model, cfg.optimizers, "cpu")
    toks = torch.randint(0, cfg.model.vocab_size, (1, 33), generator=torch.Generator().manual_seed(env.rank))
    F.cross_entropy(model(toks[:, :-1]).flatten(0, 1), toks[:, 1:].flatten()).backward()
    for o in opts: o.step(); o.zero_grad(set_to_none=True)
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())/"gg_bench_checkpoint"
    if env.is_main: shutil.rmtree(base, ignore_errors=True); base.mkdir(parents=True)
    barrier()
    meta = dict(stage="pretraining", architecture=cfg.model.architecture, config=cfg.to_dict())
    res = {k: dict(blocked=[], extra_rss=[], written=[], load=[]) for k in ("full", "sharded", "async")}

    def save_full(mgr, step):
        msd, osd = full_state(model, opts)
        if env.is_main: mgr.save(step, dict(meta, model=msd, optimizers=osd))
        del msd, osd
        barrier()

    for rnd in range(args.rounds):
        for name in ("full", "sharded", "async"):
            release_memory(); barrier()
            mgr = CheckpointManager(base/name, keep_last=1, keep_best=False, async_save=name == "async")
            with PeakRSS() as mem:
                t0 = time.perf_counter()
                if name == "full": save_full(mgr, rnd + 1)
                else: mgr.save_sharded(rnd + 1, sharded_state(model, opts), meta)
                blocked = time.perf_counter() - t0
                mgr.wait()
                written = time.perf_counter() - t0
            barrier()
            r = res[name]
            r["blocked"].append(blocked); r["written"].append(written); r["extra_rss"].append(mem.extra)
            release_memory(); barrier()
            t0 = time.perf_counter()
            if name == "full":
                ck = load_checkpoint(base/"full")
                load_full_state(model, opts, ck["model"], ck["optimizers"]); del ck
            else: load_sharded_state(mgr.latest(), model, opts)
            barrier()
            r["load"].append(time.perf_counter() - t0)
    ranks = all_gather_objects(res)
    if env.is_main:
        with torch.device("meta"): n = count_parameters(build_model(cfg.model))
        sizes = {k: sum(f.stat().st_size for f in (base/k).rglob("*") if f.is_file()) for k in res}
        print(json.dumps(dict(parameters=n, world_size=env.world_size, ranks=ranks, bytes_on_disk=sizes)))
        shutil.rmtree(base, ignore_errors=True)
    destroy_distributed()

def main(argv=None):
    args = parse_args(argv)
    if args.worker: return worker(args)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks), __file__,
           "--worker", "--rounds", str(args.rounds)] + (["--dir", args.dir] if args.dir else []) + \
          (["--set", *args.overrides] if args.overrides else [])
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    if r.returncode != 0: sys.exit(f"torchrun failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    med = lambda xs: statistics.median(xs)
    r0 = res["ranks"][0]
    out = dict(parameters=res["parameters"], world_size=res["world_size"], rounds=len(r0["full"]["blocked"]),
               bytes_on_disk=res["bytes_on_disk"])
    print(f"{res['parameters']:,} parameters + AdamW, {res['world_size']} CPU ranks (gloo), medians of "
          f"{out['rounds']} rounds; rank 0:")
    print(f"  {'':8s} {'blocked s':>10s} {'written s':>10s} {'extra RSS MiB':>14s} {'load s':>8s}")
    for k in ("full", "sharded", "async"):
        m = {f: med(r0[k][f]) for f in ("blocked", "written", "extra_rss", "load")}
        out[k] = m
        print(f"  {k:8s} {m['blocked']:10.2f} {m['written']:10.2f} {m['extra_rss'] / 2**20:14.0f} {m['load']:8.2f}")
    ratio = lambda a, b: round(a / b, 4) if b else None   # a tiny model's save may not raise the resident set at all
    out["async_blocked_over_full"] = ratio(out["async"]["blocked"], out["full"]["blocked"])
    out["sharded_peak_over_full"] = ratio(out["sharded"]["extra_rss"], out["full"]["extra_rss"])
    out["async_peak_over_full"] = ratio(out["async"]["extra_rss"], out["full"]["extra_rss"])
    out["smoke"] = args.smoke
    print(f"  async blocked / full blocked = {out['async_blocked_over_full']} (target <= 0.2); rank-0 extra memory, "
          f"sharded / full = {out['sharded_peak_over_full']}, async / full = {out['async_peak_over_full']} "
          f"(target <= 0.6)")
    print(json.dumps(out))

if __name__ == "__main__":
    main()
