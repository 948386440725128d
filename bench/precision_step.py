"""The debug recipe's training step in fp32 and under bf16 autocast, side by side in one process.

The debug recipe's model (dim 128, 4 layers, 4/2 heads, vocab 4096) on one micro-batch of 8 x 256 tokens: forward
with the fused loss, backward, fused AdamW on fp32 weights; the two run in alternating order, 4 steps a round.

    python bench/precision_step.py THREADS ROUNDS        # e.g. python bench/precision_step.py 1 10
    python bench/precision_step.py --smoke               # 2 x 32 tokens, one round of one step

The last line of stdout is one JSON object with the figures.
"""
import argparse, json, torch, time, statistics, copy
import model_step as ms
from common import add_smoke
from gradient_garden.config import ModelConfig
from gradient_garden.models.tendril import Tendril
p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("threads", type=int, nargs="?", default=1)
p.add_argument("rounds", type=int, nargs="?", default=10)
args = add_smoke(p).parse_args()
B, T, steps = (2, 32, 1) if args.smoke else (8, 256, 4)
if args.smoke: args.rounds = 1
torch.set_num_threads(args.threads)
cfg = ModelConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=4096, multiple_of=64, max_seq_len=256)
torch.manual_seed(0); base = Tendril(cfg)
g = torch.Generator().manual_seed(1)
xy = torch.randint(0, 4096, (B, T + 1), generator=g); x, y = xy[:, :-1].contiguous(), xy[:, 1:].contiguous()
runs = {}
for n in ["fp32", "bf16"]:
    m = copy.deepcopy(base)
    runs[n] = (m, torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True), torch.bfloat16 if n == "bf16" else None)
    for _ in range(1 if args.smoke else 3): ms.step(*runs[n][:2], x, y, runs[n][2], "cpu")
ts, cs = {n: [] for n in runs}, {n: [] for n in runs}
for r in range(args.rounds):
    for n in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
        m, o, ad = runs[n]
        t, c = time.perf_counter(), time.process_time()
        for _ in range(steps): ms.step(m, o, x, y, ad, "cpu")
        ts[n].append((time.perf_counter() - t) / steps); cs[n].append((time.process_time() - c) / steps)
for n in runs:
    print(f"{n}: median {statistics.median(ts[n])*1e3:.1f} ms (cpu {statistics.median(cs[n])*1e3:.1f}), "
          f"min {min(ts[n])*1e3:.1f}")
print(f"fp32/bf16: median {statistics.median(ts['fp32'])/statistics.median(ts['bf16']):.2f}x, "
      f"cpu {statistics.median(cs['fp32'])/statistics.median(cs['bf16']):.2f}x, "
      f"min {min(ts['fp32'])/min(ts['bf16']):.2f}x")
print(json.dumps(dict(bench="precision_step", smoke=args.smoke, threads=args.threads, rounds=args.rounds,
                      batch_size=B, seq_len=T,
                      step_ms={n: round(statistics.median(v) * 1e3, 2) for n, v in ts.items()},
                      step_cpu_ms={n: round(statistics.median(v) * 1e3, 2) for n, v in cs.items()},
                      fp32_over_bf16=round(statistics.median(ts["fp32"]) / statistics.median(ts["bf16"]), 3),
                      fp32_over_bf16_cpu_time=round(statistics.median(cs["fp32"]) / statistics.median(cs["bf16"]), 3))))
