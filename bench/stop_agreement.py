"""The stop agreement's cost per step on N CPU gloo ranks, side by side in the same processes: a loop of steps that
only wait (`--step-ms`, as a host waits for its GPU) with no agreement, with the old all-reduce on the CPU group
every step (`agree`), and with `Agreement` (once every `k` steps, `k` from `runtime.stop_check_s`). Every mode ends
with one agreement, so each counts the wait for the slowest rank. Also the TCP sockets each rank holds once the
run's groups exist. A least-squares line in N - 1 through the measured worlds models 512 ranks. Last line: one JSON
object.

    python bench/stop_agreement.py [--worlds 2 4 8] [--steps 200] [--step-ms 5] [--rounds 3] [--every-s 2]
    python bench/stop_agreement.py --smoke
"""
import argparse, json, os, statistics, sys, tempfile, time
from pathlib import Path
import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import add_smoke, apply_smoke

MODES = ("bare", "every_step", "every_k")


def rank_body(rank, world, init, out, steps, step_ms, rounds, every_s):
    "One rank: the three loops, `rounds` times in turn; rank 0 writes the medians (seconds per step) and sockets."
    from gradient_garden.config import RuntimeConfig
    from gradient_garden.parallel.distributed import Agreement, agree, init_distributed
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    env = init_distributed(RuntimeConfig(device="cpu"))
    agree(env, [0]); dist.barrier()   # every pair that the groups connect is open now
    sockets = len(psutil.Process().net_connections(kind="tcp"))
    per, ks = {m: [] for m in MODES}, []
    for _ in range(rounds):
        for mode in MODES:
            agreement = Agreement(every_s)
            agree(env, [0])
            t0 = time.perf_counter()
            for _ in range(steps):
                time.sleep(step_ms / 1000)
                if mode == "every_step": agree(env, [0])
                elif mode == "every_k": agreement(env, [0])
            agree(env, [0])   # every mode ends together
            per[mode].append((time.perf_counter() - t0) / steps)
            if mode == "every_k": ks.append(agreement.k)
    if rank == 0:
        Path(out).write_text(json.dumps(dict(sockets=sockets, k=max(ks), **{m: statistics.median(v)
                                                                          for m, v in per.items()})))
    dist.barrier(); dist.destroy_process_group()
    os._exit(0)


def measure(world, args) -> dict:
    "The medians of one world size, in milliseconds per step (overheads: over the bare loop)."
    with tempfile.TemporaryDirectory() as d:
        out = Path(d)/"r.json"
        mp.spawn(rank_body, args=(world, f"{d}/init", str(out), args.steps, args.step_ms, args.rounds, args.every_s),
                 nprocs=world, join=True)
        r = json.loads(out.read_text())
    ms = {m: r[m] * 1e3 for m in MODES}
    return dict(bare_ms=round(ms["bare"], 3), every_step_overhead_ms=round(ms["every_step"] - ms["bare"], 3),
                every_k_overhead_ms=round(ms["every_k"] - ms["bare"], 3), k=r["k"], sockets_per_rank=r["sockets"])


def line_at(xs, ys, x):
    "The least-squares line through (xs, ys), evaluated at x (one point: through the origin)."
    if len(xs) == 1: return ys[0] / xs[0] * x
    mx, my = statistics.mean(xs), statistics.mean(ys)
    b = sum((a - mx) * (c - my) for a, c in zip(xs, ys)) / sum((a - mx) ** 2 for a in xs)
    return my + b * (x - mx)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-ms", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--every-s", type=float, default=2.0)
    args = apply_smoke(add_smoke(p).parse_args(argv), worlds=[2], steps=20, rounds=1)
    worlds = {n: measure(n, args) for n in args.worlds}
    for n, r in worlds.items(): print(f"{n} ranks: {r}", file=sys.stderr)
    xs = [n - 1 for n in worlds]
    model = dict(every_step_overhead_ms=round(line_at(xs, [r["every_step_overhead_ms"] for r in worlds.values()],
                                                      511), 2),
                 sockets_per_rank=round(line_at(xs, [r["sockets_per_rank"] for r in worlds.values()], 511)))
    print(json.dumps(dict(smoke=args.smoke, step_ms=args.step_ms, every_s=args.every_s, worlds=worlds,
                          model_512=model)))


if __name__ == "__main__":
    main()
