"""The debug recipe's training step in fp32 and under bf16 autocast, side by side in one process.

The debug recipe's model (dim 128, 4 layers, 4/2 heads, vocab 4096) on one micro-batch of 8 x 256 tokens: forward
with the fused loss, backward, fused AdamW on fp32 weights; the two run in alternating order, 4 steps a round.

    python bench/precision_step.py THREADS ROUNDS        # e.g. python bench/precision_step.py 1 10
"""
import sys, torch, time, statistics, copy
import model_step as ms
from gradient_garden.config import ModelConfig
from gradient_garden.models.tendril import Tendril
torch.set_num_threads(int(sys.argv[1]))
cfg = ModelConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=4096, multiple_of=64, max_seq_len=256)
torch.manual_seed(0); base = Tendril(cfg)
g = torch.Generator().manual_seed(1)
xy = torch.randint(0, 4096, (8, 257), generator=g); x, y = xy[:, :-1].contiguous(), xy[:, 1:].contiguous()
runs = {}
for n in ["fp32", "bf16"]:
    m = copy.deepcopy(base); runs[n] = (m, torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True), torch.bfloat16 if n == "bf16" else None)
    for _ in range(3): ms.step(*runs[n][:2], x, y, runs[n][2], "cpu")
ts, cs = {n: [] for n in runs}, {n: [] for n in runs}
for r in range(int(sys.argv[2])):
    for n in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
        m, o, ad = runs[n]
        t, c = time.perf_counter(), time.process_time()
        for _ in range(4): ms.step(m, o, x, y, ad, "cpu")
        ts[n].append((time.perf_counter() - t) / 4); cs[n].append((time.process_time() - c) / 4)
for n in runs: print(f"{n}: median {statistics.median(ts[n])*1e3:.1f} ms (cpu {statistics.median(cs[n])*1e3:.1f}), min {min(ts[n])*1e3:.1f}")
print(f"fp32/bf16: median {statistics.median(ts['fp32'])/statistics.median(ts['bf16']):.2f}x, cpu {statistics.median(cs['fp32'])/statistics.median(cs['bf16']):.2f}x, min {min(ts['fp32'])/min(ts['bf16']):.2f}x")
