"""Per-rank peak memory of an FSDP2 training step without activation checkpointing, measured with FSDPMemTracker.

Runs on 2 gloo ranks (CPU) under torchrun: a Tendril sharded per block and at the root, AdamW, two steps of one
micro-batch; the peak is taken over the second step. It measures whichever `gradient_garden` is first on the path,
so the fused layout (`wqkv`, `w13` stored fused) and the layout before it (q/k/v and w1/w3 concatenated in every
forward, the copy kept for the backward) are compared by running it twice, once per checkout:

    torchrun --standalone --nproc-per-node 2 bench/fused_memory.py
    PYTHONPATH=/path/to/older/checkout torchrun --standalone --nproc-per-node 2 bench/fused_memory.py
    python bench/fused_memory.py --smoke        # starts its own 2 ranks under torchrun; dim 128, 2 layers: seconds

Also printed: the "gathered-copy term", the bytes of every block's q/k/v and w1/w3 weights unsharded, which the old
layout kept alive from the forward to the backward. The last line of stdout (rank 0) is one JSON object.
"""
from __future__ import annotations
import argparse, json, os, subprocess, sys
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
import gradient_garden
from gradient_garden.config import ModelConfig
from gradient_garden.models.tendril import Tendril
from common import add_smoke, apply_smoke

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    args = apply_smoke(add_smoke(p).parse_args(argv), dim=128, n_layers=2, vocab_size=1024, batch_size=1, seq_len=32)
    if "RANK" not in os.environ:   # not started by torchrun: start the 2 ranks under it, pass rank 0's lines on
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
               *(sys.argv[1:] if argv is None else argv)]
        r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if r.returncode: sys.exit(f"torchrun failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
        print(r.stdout.strip())
        return
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    cfg = ModelConfig(dim=args.dim, n_layers=args.n_layers, n_heads=args.dim // 64, n_kv_heads=args.dim // 128,
                      vocab_size=args.vocab_size, max_seq_len=args.seq_len)
    torch.manual_seed(0)
    model = Tendril(cfg)
    names = [n for n, _ in model.named_parameters() if n.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight",
                                                                    "w3.weight", "wqkv.weight", "w13.weight"))]
    term = sum(dict(model.named_parameters())[n].numel() * 4 for n in names)
    for block in model.layers: fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len), generator=g)
    tracker = FSDPMemTracker(model, opt)
    tracker.track_inputs((tokens,))
    with tracker:
        for step in range(2):
            model(tokens, labels=tokens).backward()
            opt.step(); opt.zero_grad()
            if step == 0: tracker.reset_mod_stats()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak)
    if dist.get_rank() == 0:
        layout = "fused" if any("wqkv" in n for n in names) else "unfused"
        print(f"{gradient_garden.__file__}: {layout} layout, per-rank peak {max(peaks) / 2**20:.2f} MiB "
              f"(ranks {[round(x / 2**20, 2) for x in peaks]}); gathered-copy term {term / 2**20:.2f} MiB")
        print(json.dumps(dict(bench="fused_memory", smoke=args.smoke, layout=layout, peak_bytes=peaks,
                              gathered_copy_term_bytes=term, dim=args.dim, n_layers=args.n_layers,
                              vocab_size=args.vocab_size, batch_size=args.batch_size, seq_len=args.seq_len)))
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
