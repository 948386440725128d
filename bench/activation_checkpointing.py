"""Activation checkpointing at the 124M shape: peak activation memory and step time for none / selective / full.

The model is `recipes/pretraining/tendril-124m.yaml`'s (dim 768, 12 layers, 12 heads, vocab 49152, tied embeddings)
at sequence length 1024. For each mode one forward + backward is measured by `MemTracker` (peak bytes of tensors
filed as activations or temporaries: everything but parameters, gradients and optimizer state); then the modes run
round-robin for `--rounds` rounds (side by side, so machine load hits them alike) and the median step time of each
is reported with its ratio to `none`. `block2` (full checkpointing of every second block, the block-level variant
of selective) is measured for comparison.

    # CPU, micro batch 2, writes bench/results/activation_checkpointing.json
    python bench/activation_checkpointing.py
    python bench/activation_checkpointing.py --device cuda --batch-size 8 --dtype bf16
    python bench/activation_checkpointing.py --smoke          # the recipe's model shrunk to dim 64, 2 layers: seconds

The last line of stdout is one JSON object with the figures.
"""
from __future__ import annotations
import argparse, json, statistics, sys, time
from pathlib import Path
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from common import add_smoke, apply_smoke, results_path
from gradient_garden.recipes import load_recipe
from gradient_garden.models.tendril import count_parameters
from gradient_garden.models.registry import build_model
from gradient_garden.parallel.activation_checkpointing import (apply_activation_checkpointing, activation_peak,
                                                               checkpoint_module)

MODES = ("none", "selective", "full", "block2")

def build(cfg, mode: str, device):
    "The 124M model with activation checkpointing `mode` applied."
    torch.manual_seed(0)
    model = build_model(cfg.model).to(device)
    if mode == "block2":
        for block in model.layers[::2]: checkpoint_module(block, "full")
        return model
    return apply_activation_checkpointing(model, mode)

def step(model, tokens, dtype):
    "One forward + backward; returns seconds."
    t0 = time.perf_counter()
    with torch.autocast(tokens.device.type, dtype=dtype, enabled=dtype is not None):
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]) / tokens[:, 1:].numel()
    loss.backward()
    if tokens.device.type == "cuda": torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default=str(ROOT/"recipes"/"pretraining"/"tendril-124m.yaml"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--out", default=str(ROOT/"bench"/"results"/"activation_checkpointing.json"))
    args = apply_smoke(add_smoke(p).parse_args(argv), batch_size=1, seq_len=64, rounds=1)
    if args.smoke: args.out = str(results_path(args.out, True))
    cfg = load_recipe(args.recipe).config
    mc = cfg.model
    if args.smoke: mc.dim, mc.n_layers, mc.n_heads, mc.n_kv_heads, mc.vocab_size = 64, 2, 4, 2, 1024
    device, dtype = torch.device(args.device), (torch.bfloat16 if args.dtype == "bf16" else None)
    modes = args.modes.split(",")
    tokens = torch.randint(0, cfg.model.vocab_size, (args.batch_size, args.seq_len + 1),
                           generator=torch.Generator().manual_seed(0)).to(device)
    models = {m: build(cfg, m, device) for m in modes}
    res = dict(smoke=args.smoke, parameters=count_parameters(models[modes[0]]), batch_size=args.batch_size,
               seq_len=args.seq_len, device=device.type, dtype=args.dtype, threads=torch.get_num_threads(), modes={})
    for m in modes:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            res["modes"][m] = activation_peak(models[m], tokens)
        step(models[m], tokens, dtype)  # warm-up
    times = {m: [] for m in modes}
    for _ in range(args.rounds):
        for m in modes: times[m].append(step(models[m], tokens, dtype))
    base = res["modes"]["none"]
    for m in modes:
        r = res["modes"][m]
        r["step_s"] = statistics.median(times[m])
        r["activation_ratio"] = r["activations"] / base["activations"]
        r["time_ratio"] = r["step_s"] / statistics.median(times["none"])
        print(f"{m:9s} activations {r['activations'] / 2**20:8.1f} MiB ({r['activation_ratio']:.2f}x)  "
              f"step {r['step_s']:6.2f} s ({r['time_ratio']:.2f}x)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res))

if __name__ == "__main__":
    main()
