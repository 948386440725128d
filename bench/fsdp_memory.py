"""Per-rank memory of data parallelism: parameters + gradients + optimizer state under DDP, FSDP2 and HSDP, same model.

The launcher starts `--ranks` processes under torchrun (gloo on CPU, NCCL with one GPU per rank); in each, the same
Tendril (the debug recipe's model unless overridden) is wrapped with DDP, with FSDP2 (per block + root, sharded over
every rank) and, with 4 or more ranks, with HSDP (`--replicate` x ranks/replicate mesh: sharded within a shard
group, replicated across groups; per-rank memory = parameters / shard degree),
trained for two optimizer steps of two micro-steps each on random tokens with the platform's own optimizers (AdamW,
and Muon for the hidden matrices), and measured with `memory_footprint` just before the second optimizer step, when
parameters, gradients and optimizer state all exist. Bytes are counted per rank from the tensors it holds (local
shards under FSDP2); DDP's internal all-reduce buckets are not included. On CUDA the allocator's peak over the
two steps is reported as well.

    python bench/fsdp_memory.py                      # 2 CPU ranks, gloo, the debug recipe's model
    python bench/fsdp_memory.py --ranks 4                  # adds HSDP 2 x 2
    python bench/fsdp_memory.py --ranks 4 --device cuda --set model.dim=1024 model.n_layers=16
    python bench/fsdp_memory.py --smoke                    # 2 CPU ranks, dim 64, 2 layers, 1 x 16 tokens: seconds

The last line of stdout is one JSON object with the figures.
"""
from __future__ import annotations
import argparse, json, os, subprocess, sys
from pathlib import Path
import torch
import torch.nn.functional as F
from common import add_smoke

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=1024"]

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--recipe", default=str(ROOT/"recipes"/"pretraining"/"debug.yaml"))
    p.add_argument("--set", nargs="*", default=[], dest="overrides", help="config overrides, e.g. model.dim=256")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--replicate", type=int, default=2, help="HSDP replicate degree (with 4 or more ranks)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = add_smoke(p).parse_args(argv)
    if args.smoke and not args.worker:
        args.ranks, args.device, args.batch_size, args.seq_len, args.overrides = 2, "cpu", 1, 16, TINY + args.overrides
    return args

def measure(cfg, env, wrapper: str, muon: bool, args) -> dict:
    "Footprint (bytes) of one wrapped model (`ddp`, `fsdp2` or `hsdp`) before its second optimizer step."
    from gradient_garden.config import RuntimeConfig
    from gradient_garden.models.registry import build_model
    from gradient_garden.parallel.distributed import parallelize, grad_sync, memory_footprint
    from gradient_garden.train.optim import build_optimizers
    cfg.optimizers.muon.enabled = muon
    torch.manual_seed(0)
    mesh = dict(replicate=args.replicate, shard=env.world_size // args.replicate) if wrapper == "hsdp" else \
           dict(replicate=1, shard=env.world_size) if wrapper == "fsdp2" else {}
    runtime = RuntimeConfig(device=args.device, fsdp=wrapper != "ddp", **mesh)
    model = parallelize(build_model(cfg.model).to(env.device), runtime, env)
    opts = build_optimizers(model, cfg.optimizers, env.device.type)
    gen = torch.Generator().manual_seed(env.rank)
    if env.device.type == "cuda": torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(env.device)
    for step in range(2):
        for micro in range(2):
            toks = torch.randint(0, cfg.model.vocab_size, (args.batch_size, args.seq_len + 1),
                                 generator=gen).to(env.device)
            with grad_sync(model, sync=micro == 1):
                F.cross_entropy(model(toks[:, :-1]).flatten(0, 1), toks[:, 1:].flatten()).backward()
        if step == 1: fp = memory_footprint(model, opts)
        for o in opts: o.step(); o.zero_grad(set_to_none=True)
    fp["total"] = fp["parameters"] + fp["gradients"] + fp["optimizer"]
    if env.device.type == "cuda": fp["cuda_peak_allocated"] = torch.cuda.max_memory_allocated(env.device)
    return fp

def worker(args):
    "One rank: measure every (wrapper, optimizer) pair; rank 0 prints all ranks' figures as JSON."
    from gradient_garden.config import RuntimeConfig
    from gradient_garden.recipes import load_config
    from gradient_garden.parallel.collectives import all_gather_objects
    from gradient_garden.parallel.distributed import init_distributed, destroy_distributed
    from gradient_garden.models.tendril import count_parameters
    from gradient_garden.models.registry import build_model
    env = init_distributed(RuntimeConfig(device=args.device))
    cfg, _ = load_config(recipe=args.recipe, overrides=args.overrides)
    wrappers = ("ddp", "fsdp2") + (("hsdp",) if env.world_size >= 4 and env.world_size % args.replicate == 0 else ())
    mine = {f"{w}/{o}": measure(cfg, env, w, o == "muon", args) for o in ("adamw", "muon") for w in wrappers}
    ranks = all_gather_objects(mine)
    if env.is_main:
        with torch.device("meta"): n = count_parameters(build_model(cfg.model))
        print(json.dumps(dict(parameters=n, ranks=ranks, world_size=env.world_size, device=str(env.device.type))))
    destroy_distributed()

def main(argv=None):
    args = parse_args(argv)
    if args.worker: return worker(args)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks),
           __file__, "--worker", "--device", args.device, "--recipe", args.recipe, "--batch-size", str(args.batch_size),
           "--seq-len", str(args.seq_len), "--replicate", str(args.replicate)]
    cmd += ["--set", *args.overrides] if args.overrides else []
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    if r.returncode != 0: sys.exit(f"torchrun failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    mb = lambda b: b / 2**20
    print(f"{res['parameters']:,} parameters, {res['world_size']} ranks ({res['device']}); MiB per rank "
          f"(parameters + gradients + optimizer = total), max over ranks:")
    out = dict(smoke=args.smoke, parameters=res["parameters"], world_size=res["world_size"], device=res["device"])
    for key in res["ranks"][0]:
        worst = {k: max(r[key][k] for r in res["ranks"]) for k in res["ranks"][0][key]}
        out[key.replace("/", "_")] = worst
        print(f"  {key:13s} {mb(worst['parameters']):7.2f} + {mb(worst['gradients']):7.2f} + "
              f"{mb(worst['optimizer']):7.2f} = {mb(worst['total']):7.2f}")
    for o in ("adamw", "muon"):
        ratio = out[f"fsdp2_{o}"]["total"] / out[f"ddp_{o}"]["total"]
        out[f"fsdp2_over_ddp_{o}"] = round(ratio, 4)
        print(f"  FSDP2 / DDP with {o}: {ratio:.3f} (ideal 1/{res['world_size']} = {1 / res['world_size']:.3f})")
        if f"hsdp_{o}" in out:
            shard = res["world_size"] // args.replicate
            out[f"hsdp_over_ddp_{o}"] = round(out[f"hsdp_{o}"]["total"] / out[f"ddp_{o}"]["total"], 4)
            print(f"  HSDP {args.replicate} x {shard} / DDP with {o}: {out[f'hsdp_over_ddp_{o}']:.3f} "
                  f"(ideal 1/{shard} = {1 / shard:.3f})")
    print(json.dumps(out))

if __name__ == "__main__":
    main()
