"""Drawing the next token: `torch.multinomial` (an exponential variate per vocabulary entry) against the package's
`sample_categorical` (one uniform per row and a binary search in the cumulative sum), side by side in one process.

For each (rows, vocabulary) shape, the median time of one draw from the softmax of random logits, each method's, and
the ratio; and, as the check that both draw from the same distribution, the largest gap between their token
frequencies over many draws from one 8-token distribution, with the tolerance its sampling noise allows.

    python bench/sampling.py                   # torch's threads
    python bench/sampling.py --threads 1
    python bench/sampling.py --smoke           # two small shapes, a few calls: seconds

The last line of stdout is one JSON object with the figures.
"""
from __future__ import annotations
import argparse, json, statistics, time
import torch
from common import add_smoke
from gradient_garden.generation import sample_categorical

# (rows, vocabulary): one stream; a serving batch; RL's groups (8 prompts x 16) over the debug vocabulary;
# Llama 2 / Mistral's and Llama 3's vocabularies
SHAPES = [(1, 4096), (8, 4096), (128, 4096), (8, 32000), (1, 128256), (32, 128256)]


def median_ms(f, calls: int, repeats: int) -> float:
    "Median over `repeats` of the mean time of `calls` calls, in milliseconds."
    f()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls): f()
        ts.append((time.perf_counter() - t0) / calls * 1e3)
    return statistics.median(ts)


def frequency_gap(draws: int, seed: int = 0) -> tuple[float, float]:
    "Largest |frequency difference| of the two methods over `draws` draws of one distribution, and 5 sigma of it."
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(8, generator=g), -1)
    a = torch.multinomial(p.repeat(draws, 1), 1, generator=g).squeeze(-1).bincount(minlength=8) / draws
    b = sample_categorical(p.repeat(draws, 1), g).bincount(minlength=8) / draws
    return float((a - b).abs().max()), float(5 * (2 * p.max() * (1 - p.max()) / draws) ** 0.5)


def main():
    p = add_smoke(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    if args.threads: torch.set_num_threads(args.threads)
    shapes, calls, repeats, draws = (SHAPES[:2], 3, 2, 20_000) if args.smoke else (SHAPES, args.calls, args.repeats,
                                                                                   400_000)
    g, rows = torch.Generator().manual_seed(0), []
    for b, v in shapes:
        probs = torch.softmax(3 * torch.randn(b, v, generator=g), -1)
        torch_ms = median_ms(lambda: torch.multinomial(probs, 1, generator=g), calls, repeats)
        ours_ms = median_ms(lambda: sample_categorical(probs, g), calls, repeats)
        rows.append({"rows": b, "vocab": v, "multinomial_ms": round(torch_ms, 4), "inverse_cdf_ms": round(ours_ms, 4),
                     "speedup": round(torch_ms / ours_ms, 2)})
        print(f"{b:>4} x {v:<7} multinomial {torch_ms:8.3f} ms   inverse cdf {ours_ms:7.3f} ms   "
              f"{torch_ms / ours_ms:5.1f}x")
    gap, tol = frequency_gap(draws)
    print(f"same distribution: largest frequency gap {gap:.4f} over {draws:,} draws each (5 sigma: {tol:.4f})")
    print(json.dumps({"threads": torch.get_num_threads(), "shapes": rows, "frequency_gap": round(gap, 5),
                      "frequency_gap_5_sigma": round(tol, 5), "smoke": args.smoke}))


if __name__ == "__main__":
    main()
