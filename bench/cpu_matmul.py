"""CPU matmuls of a few rows, the shape of decoding: MKL (`F.linear`) against oneDNN on prepacked weights, fp32, bf16.

For each weight shape and row count, the median time of one call, MKL fp32 / oneDNN fp32 (prepacked with
`torch.ops.mkldnn._reorder_linear_weight`, as `generation.hold_decode_weights` holds them) / oneDNN bf16, and a
1024^3 GEMM's GFLOP/s in each. `models.attention.packed_min_macs()` finds where oneDNN's fixed cost per call stops
losing to MKL in fp32 by a shorter measurement of the same kind, on first use on each machine.

    python bench/cpu_matmul.py                 # torch's threads
    python bench/cpu_matmul.py --threads 1
    python bench/cpu_matmul.py --smoke         # two shapes, two row counts, a few calls: seconds

The last line of stdout is one JSON object with the figures.
"""
from __future__ import annotations
import argparse, json, statistics, time
import torch
import torch.nn.functional as F
from common import add_smoke

SHAPES = [(128, 128), (256, 256), (512, 256), (1536, 256), (4096, 128), (2304, 768)]
ROWS = [1, 2, 4, 8, 16, 32]

CALLS, REPEATS, WARMUP, GEMM_N = 300, 5, 20, 1024

def median_us(f, calls: int = None, repeats: int = None) -> float:
    "Median over `repeats` of the mean time of `calls` calls, in microseconds."
    calls, repeats = calls or CALLS, repeats or REPEATS
    for _ in range(WARMUP): f()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls): f()
        ts.append((time.perf_counter() - t) / calls)
    return statistics.median(ts) * 1e6

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=None)
    args = add_smoke(p).parse_args(argv)
    if args.threads: torch.set_num_threads(args.threads)
    global SHAPES, ROWS, CALLS, REPEATS, WARMUP, GEMM_N
    if args.smoke: SHAPES, ROWS, CALLS, REPEATS, WARMUP, GEMM_N = SHAPES[:2], [1, 8], 5, 1, 2, 256
    mk, out = torch.ops.mkldnn, {}
    # oneDNN's bf16 matmul needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; without them its column is null
    bf16 = mk._is_mkldnn_bf16_supported()
    print(f"threads {torch.get_num_threads()}; us per call, MKL fp32 / oneDNN fp32 / oneDNN bf16"
          + ("" if bf16 else " (not on this CPU: oneDNN has no bf16 matmul here)"))
    with torch.inference_mode():
        for o, i in SHAPES:
            w = torch.randn(o, i)
            p32 = mk._reorder_linear_weight(w, 8)
            p16 = mk._reorder_linear_weight(w.bfloat16(), 8) if bf16 else None
            row = {}
            for m in ROWS:
                x = torch.randn(m, i); xb = x.bfloat16()
                row[m] = [round(median_us(f), 1) for f in (lambda: F.linear(x, w),
                                                           lambda: mk._linear_pointwise(x, p32, None, "none", [], ""))]
                row[m].append(round(median_us(lambda: mk._linear_pointwise(xb, p16, None, "none", [], "")), 1)
                              if bf16 else None)
            out[f"{o}x{i}"] = row
            print(f"{o:>5} x {i:<4} " + "  ".join(f"{m}: {a:.0f}/{b:.0f}/{'-' if c is None else f'{c:.0f}'}"
                                                  for m, (a, b, c) in row.items()))
        n = GEMM_N
        a = torch.randn(n, n); pa = mk._reorder_linear_weight(a, n)
        pb = mk._reorder_linear_weight(a.bfloat16(), n) if bf16 else None
        flops = 2 * n ** 3
        calls = {"mkl_fp32": lambda: a @ a, "onednn_fp32": lambda: mk._linear_pointwise(a, pa, None, "none", [], ""),
                 "onednn_bf16": (lambda: mk._linear_pointwise(a.bfloat16(), pb, None, "none", [], ""))
                 if bf16 else None}
        gemm = {name: None if f is None else round(flops / median_us(f, calls=min(20, CALLS)) / 1e3, 1)
                for name, f in calls.items()}
    print(f"{n}^3 GEMM GFLOP/s: " + ", ".join(f"{k} {v}" for k, v in gemm.items()))
    print(json.dumps(dict(bench="cpu_matmul", smoke=args.smoke, gemm_n=n, threads=torch.get_num_threads(),
                          torch=torch.__version__, onednn_bf16=bf16, us_per_call=out, gemm_gflops=gemm)))

if __name__ == "__main__":
    main()
