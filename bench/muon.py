"""Muon's optimizer step on 1, 2 and 4 gloo ranks: the gathered algorithm (every rank orthogonalises every matrix)
against the distributed one (each matrix once, on an owner rank), overlapped (the default: each bucket's collectives
run under the next bucket's Newton-Schulz) and one bucket at a time (`overlap=False`), side by side in one run.

In each world the same Tendril (GQA, so the matrices come in four shapes) is wrapped with FSDP2 (and, separately,
DDP), one backward makes the gradients, and two Muon optimizers over the same parameters, `distributed=False` and
`distributed=True`, step in alternation for `--rounds` rounds (the same gradients each time; each step is timed
between barriers, and a step's time is the slowest rank's). Newton-Schulz FLOPs are counted per rank by running every
Newton-Schulz call under torch's `FlopCounterMode` (matmul FLOPs only). Newton-Schulz runs in fp32, as
`ns_dtype: auto` does on CPU. The machine may be shared: medians are reported.

    python bench/muon.py                    # 1, 2 and 4 ranks, about 2-4 minutes on 2 busy cores
    python bench/muon.py --dim 384 --rounds 9       # larger matrices
    python bench/muon.py --smoke                    # 1 and 2 ranks, dim 64, one layer, one round: seconds

The last line of stdout is one JSON object: `ns_flops_per_rank_ratio` (busiest rank / one process, for 2 and 4 ranks,
distributed) and `step_time_ratio` (2 ranks FSDP2, distributed / gathered median step time), with the details;
`critical_path_over_ideal`: each distributed step (overlapped, and one bucket at a time) against the ideal, one
process's step divided by the ranks; `critical_path_over_ideal_in_run`: the same against the ideal measured in the
same run (`alone`: every rank steps a plain copy of the model by itself, in the same alternation, so the ideal sees
the same load and the same sharing of cores); `overlapped_over_blocking`: the two distributed steps' ratio.
"""
from __future__ import annotations
import argparse, json, os, statistics, tempfile, time
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import add_smoke, apply_smoke


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    return apply_smoke(add_smoke(p).parse_args(argv), dim=64, layers=1, rounds=1, worlds=[1, 2])


def count_ns_flops(counts: list):
    "Make every Newton-Schulz call of the optimizer module add its counted matmul FLOPs to `counts`."
    from torch.utils.flop_counter import FlopCounterMode
    import gradient_garden.train.optim as optim
    inner = optim.zeropower_via_newtonschulz
    def counted(*a, **k):
        with FlopCounterMode(display=False) as fc: out = inner(*a, **k)
        counts.append(fc.get_total_flops())
        return out
    optim.zeropower_via_newtonschulz = counted


def build(args, layout: str, world: int):
    "The model wrapped for `layout`, after one backward; its hidden matrices."
    from gradient_garden.config import ModelConfig
    from gradient_garden.models.registry import build_model
    from gradient_garden.train.optim import classify_parameters
    from gradient_garden.parallel.distributed import apply_fsdp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    cfg = ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=args.dim // 64, n_kv_heads=max(1, args.dim // 192),
                      vocab_size=512, multiple_of=128, max_seq_len=64)
    model = build_model(cfg)
    wrapped = model
    if layout == "fsdp2" and world > 1:
        wrapped = apply_fsdp(model, "fp32", init_device_mesh("cpu", (world,), mesh_dim_names=("shard",)))
    elif layout == "ddp" and world > 1:
        wrapped = DDP(model)
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    wrapped(tokens).float().logsumexp(-1).mean().backward()
    return wrapped, [p for _, p in classify_parameters(wrapped)["matrices"]]


def time_steps(args, layout, world, counts):
    "Median step seconds and per-rank NS FLOPs of the gathered and the distributed algorithm, alternating."
    from gradient_garden.train.optim import Muon, _replica_group
    wrapped, mats = build(args, layout, world)
    group = _replica_group(wrapped)
    algs = ("gathered", "distributed") + (("blocking",) if world > 1 else ())   # blocking: one bucket at a time
    opts = {alg: Muon(mats, lr=0.02, weight_decay=0.0, ns_dtype="fp32", distributed=alg != "gathered",
                      process_group=group, overlap=alg != "blocking") for alg in algs}
    if world > 1:   # alone: every rank steps a plain copy by itself, one process's step under this run's load
        opts["alone"] = Muon(build(args, "single", 1)[1], lr=0.02, weight_decay=0.0, ns_dtype="fp32")
    times, flops = {a: [] for a in opts}, {}
    for rnd in range(args.rounds + 1):   # round 0 warms up (and counts FLOPs)
        for alg, opt in opts.items():
            if world > 1: dist.barrier()
            n0, t0 = len(counts), time.perf_counter()
            opt.step()
            dt = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
            if world > 1: dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if rnd == 0: flops[alg] = sum(counts[n0:])
            else: times[alg].append(dt.item())
    return {alg: {"step_s": statistics.median(times[alg]), "ns_flops": flops[alg]} for alg in opts}


def rank_main(rank, world, init_file, args, out_dir):
    torch.set_num_threads(1)
    if world > 1: dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    counts = []
    count_ns_flops(counts)
    layouts = ["fsdp2", "ddp"] if world > 1 else ["single"]
    res = {layout: time_steps(args, layout, world, counts) for layout in layouts}
    with open(os.path.join(out_dir, f"w{world}_r{rank}.json"), "w") as f: json.dump(res, f)
    if world > 1:
        dist.barrier(); dist.destroy_process_group()


def main(argv=None):
    args = parse_args(argv)
    out = {"bench": "muon", "smoke": args.smoke, "dim": args.dim, "layers": args.layers, "rounds": args.rounds,
           "ns_dtype": "fp32", "threads_per_rank": 1, "machine": "shared CPU (gloo); medians", "worlds": {}}
    with tempfile.TemporaryDirectory() as d:
        for world in args.worlds:
            mp.spawn(rank_main, args=(world, os.path.join(d, f"pg{world}"), args, d), nprocs=world, join=True)
            ranks = [json.load(open(os.path.join(d, f"w{world}_r{r}.json"))) for r in range(world)]
            w = {}
            for layout in ranks[0]:
                w[layout] = {alg: {"step_s": ranks[0][layout][alg]["step_s"],
                                   "ns_flops_per_rank": [r[layout][alg]["ns_flops"] for r in ranks]}
                             for alg in ranks[0][layout]}
            out["worlds"][world] = w
            print(f"{world} rank(s): " + "; ".join(
                f"{lay} {alg} {v['step_s'] * 1e3:.0f} ms, "
                f"NS GFLOP per rank {[round(f / 1e9, 2) for f in v['ns_flops_per_rank']]}"
                for lay, algs in w.items() for alg, v in algs.items()), flush=True)
    one = max(out["worlds"][1]["single"]["gathered"]["ns_flops_per_rank"]) if 1 in out["worlds"] else None
    if one:
        ratio = lambda w, alg: max(out["worlds"][w]["fsdp2"][alg]["ns_flops_per_rank"]) / one
        out["ns_flops_per_rank_ratio"] = {str(w): ratio(w, "distributed") for w in out["worlds"] if w > 1}
        out["gathered_ns_flops_per_rank_ratio"] = {str(w): ratio(w, "gathered") for w in out["worlds"] if w > 1}
    for w in out["worlds"]:
        if w > 1:
            for lay in ("fsdp2", "ddp"):
                r = out["worlds"][w][lay]
                ratios = out.setdefault("step_time_ratios", {})
                ratios[f"{lay}_{w}"] = r["distributed"]["step_s"] / r["gathered"]["step_s"]
    if 2 in out["worlds"]: out["step_time_ratio"] = out["step_time_ratios"]["fsdp2_2"]
    if 1 in out["worlds"]:   # the ideal: one process's step divided evenly over the ranks, moves free
        one_s = out["worlds"][1]["single"]["gathered"]["step_s"]
        out["critical_path_over_ideal"] = {f"{lay}_{w}_{alg}": out["worlds"][w][lay][alg]["step_s"] * w / one_s
                                           for w in out["worlds"] if w > 1 for lay in ("fsdp2", "ddp")
                                           for alg in ("distributed", "blocking")}
        out["critical_path_over_ideal_in_run"] = {f"{lay}_{w}_{alg}": out["worlds"][w][lay][alg]["step_s"] * w
                                                  / out["worlds"][w][lay]["alone"]["step_s"]
                                                  for w in out["worlds"] if w > 1 for lay in ("fsdp2", "ddp")
                                                  for alg in ("distributed", "blocking")}
        out["overlapped_over_blocking"] = {f"{lay}_{w}": out["worlds"][w][lay]["distributed"]["step_s"]
                                           / out["worlds"][w][lay]["blocking"]["step_s"]
                                           for w in out["worlds"] if w > 1 for lay in ("fsdp2", "ddp")}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
