"""From SIGTERM to a durable checkpoint on 2 gloo ranks, against the plan's estimate.

A cluster stops a job with SIGTERM and kills it about 30 s later (`gg plan --grace-s`). Per trial: torchrun starts
`gg train` on 2 CPU ranks (DDP, or FSDP2 with `--fsdp`; either writes a sharded checkpoint folder, committed by its
`COMPLETE` marker), with checkpoints only every 1000 steps; once `--at` steps are logged, SIGTERM goes to torchrun,
and the checkpoint folder is polled every 2 ms until a complete checkpoint is listed (`list_checkpoints`).
Reported: seconds from the signal to the durable checkpoint, and to the job's exit; the checkpoint's bytes on disk
and `gg plan`'s count of them (`checkpoint_bytes`); the median step time of the run; and the storage's write rate,
measured by writing and fsyncing the same number of bytes beside it. The plan's estimate is `gg plan`'s: the
agreement to stop (up to `runtime.stop_check_s` after the signal) and the step in progress, plus the checkpoint's
bytes at that rate. Last line: one JSON object.

    python bench/save_grace.py [--dim 256] [--layers 4] [--trials 3] [--fsdp]
    python bench/save_grace.py --smoke      # one trial, dim 64, 2 layers, on random-token shards of its own
"""
import argparse, json, os, shutil, signal, statistics, subprocess, time
from pathlib import Path
from common import add_smoke, apply_smoke, smoke_dir, synthetic_pretraining_data
from preemption import ENV, RECIPE, ROOT, TORCHRUN, run_dir, sets
from gradient_garden.checkpoint.checkpoints import list_checkpoints
from gradient_garden.config import RuntimeConfig
from gradient_garden.recipes import load_config
from gradient_garden.train.plan import checkpoint_bytes, plan


def write_rate(folder: Path, nbytes: int) -> float:
    "Bytes per second of writing `nbytes` to a new file in `folder` and fsyncing it (and the folder)."
    p, block = folder/"write_rate.tmp", os.urandom(1 << 20)
    t0 = time.perf_counter()
    with open(p, "wb") as f:
        for _ in range(max(1, nbytes >> 20)): f.write(block)
        f.flush(); os.fsync(f.fileno())
    fd = os.open(folder, os.O_RDONLY); os.fsync(fd); os.close(fd)
    dt = time.perf_counter() - t0
    p.unlink()
    return max(1, nbytes >> 20) * (1 << 20) / dt


def trial(a, data: Path, out: Path) -> dict:
    "One run stopped by SIGTERM after `a.at` logged steps: the times from the signal to the checkpoint and the exit."
    shutil.rmtree(out, ignore_errors=True)
    extra = [f"model.dim={a.dim}", f"model.n_layers={a.layers}", f"model.n_heads={max(1, a.dim // 32)}",
             f"model.n_kv_heads={max(1, a.dim // 64)}", f"runtime.fsdp={a.fsdp}"]
    overrides = sets(data, out, a.at + 1000) + extra
    cfg, _ = load_config(recipe=str(ROOT/RECIPE), overrides=overrides)
    planned = checkpoint_bytes(plan(cfg, "H100", gpus_per_node=2))
    proc = subprocess.Popen(TORCHRUN + ["-m", "gradient_garden.cli", "train", "--recipe", RECIPE, "--set", *overrides],
                            cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics, ckpts = run_dir(out)/"metrics.jsonl", run_dir(out)/"checkpoints"
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= a.at):
        if proc.poll() is not None: raise RuntimeError(proc.communicate()[1][-2000:])
        time.sleep(0.01)
    t0 = time.perf_counter()
    os.kill(proc.pid, signal.SIGTERM)
    while not list_checkpoints(ckpts):
        if proc.poll() is not None and not list_checkpoints(ckpts):
            raise RuntimeError("the job ended without a checkpoint: " + proc.communicate()[1][-2000:])
        time.sleep(0.002)
    durable = time.perf_counter() - t0
    proc.communicate(timeout=300)
    exited = time.perf_counter() - t0
    ck = list_checkpoints(ckpts)[-1]
    size = ck.stat().st_size if ck.is_file() else sum(f.stat().st_size for f in ck.rglob("*") if f.is_file())
    rows = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()]
    tps = statistics.median(r["tokens_per_s"] for r in rows if r.get("tokens_per_s"))
    step_s = 1024 / tps   # sets(): 1024 tokens per optimizer step
    rate = write_rate(ckpts, size)
    return dict(durable_s=durable, exit_s=exited, checkpoint_bytes=size, plan_checkpoint_bytes=planned,
                checkpoint=ck.name, step_s=step_s,
                write_bytes_per_s=rate, plan_estimate_s=RuntimeConfig().stop_check_s + step_s + size / rate,
                returncode=proc.returncode)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--at", type=int, default=3, help="logged steps before the signal")
    ap.add_argument("--fsdp", action="store_true", help="FSDP2: a sharded checkpoint folder")
    ap.add_argument("--out", default="/tmp/gg_save_grace")
    a = apply_smoke(add_smoke(ap).parse_args(), dim=64, layers=2, trials=1, at=2)
    data = smoke_dir("save_grace_data")
    if not (data/"datasets").is_dir(): synthetic_pretraining_data(data, 1024, 50_000)
    out = smoke_dir("save_grace") if a.smoke else Path(a.out)
    rows = []
    for i in range(a.trials):
        rows.append(trial(a, data, out/f"t{i}"))
        print(json.dumps(rows[-1]), flush=True)
    med = lambda k: statistics.median(r[k] for r in rows)
    print(json.dumps(dict(bench="save_grace", smoke=a.smoke, ranks=2, fsdp=a.fsdp, dim=a.dim, layers=a.layers,
                          trials=len(rows), durable_s=med("durable_s"), exit_s=med("exit_s"),
                          plan_estimate_s=med("plan_estimate_s"), checkpoint_bytes=med("checkpoint_bytes"),
                          plan_checkpoint_bytes=med("plan_checkpoint_bytes"),
                          step_s=med("step_s"), write_bytes_per_s=med("write_bytes_per_s"),
                          load_avg=os.getloadavg()[0], rows=rows)))


if __name__ == "__main__":
    main()
