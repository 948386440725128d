"""Packed documents on flex_attention (block-sparse mask) vs SDPA with the dense document mask, side by side.

At the packed-SFT bench shape (bench/sft_packing.py: Tendril dim 128, 4 layers, 2 query heads on 1 K/V head of 64,
batch 8 x 256 tokens) with documents of about 50 tokens (`--doc-len`). Measures, interleaved over rounds (medians):
the compile time of the flex kernel, building the mask (per micro-batch), the attention call alone and the whole
model's forward without gradients, and the training step (forward + backward + AdamW) where flex can train (CUDA; on
CPU torch has no flex backward, which the JSON says). `--backend-compile` sets Inductor or another backend for the
flex kernel.

    python bench/flex_attention.py                      # CPU fp32
    python bench/flex_attention.py --device cuda --dtype bf16 --batch-size 32 --seq-len 1024
    # 2 x 64 tokens, one layer, one round; the flex kernel compiled by the `eager` backend on CPU (Inductor's C++
    # build alone takes 15 s)
    python bench/flex_attention.py --smoke

The last line of stdout is one JSON object with the figures.
"""
from __future__ import annotations
import json, statistics, time
import torch
from common import apply_smoke, bench_parser, setup, sync
from gradient_garden.config import ModelConfig
from gradient_garden.models import attention
from gradient_garden.models.attention import attention_mask, document_block_mask, flex_gqa, sdpa_gqa
from gradient_garden.models.registry import build_model


def parse_args(argv=None):
    p = bench_parser(__doc__, rounds=6, steps_per_round=5, warmup=2)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--doc-len", type=float, default=50.0, help="mean document length in tokens")
    p.add_argument("--backend-compile", default=None, help="default: inductor (eager in smoke mode on CPU)")
    args = apply_smoke(p.parse_args(argv), batch_size=2, seq_len=64, dim=64, n_layers=1, doc_len=16.0, rounds=1,
                       steps_per_round=1, warmup=1)
    if args.backend_compile is None:
        args.backend_compile = "eager" if args.smoke and args.device == "cpu" else "inductor"
    return args


def timed(f, device, n):
    "Median seconds of `n` calls of `f`."
    ts = []
    for _ in range(n):
        sync(device); t0 = time.perf_counter(); f(); sync(device); ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None):
    args = parse_args(argv)
    dev_type, dtype, autocast_dtype = setup(args)
    attention.FLEX_COMPILE_BACKEND = args.backend_compile
    torch.manual_seed(0)
    B, T, dev = args.batch_size, args.seq_len, args.device
    doc = torch.cumsum(torch.rand(B, T) < 1 / args.doc_len, -1).to(dev)
    mcfg = ModelConfig(dim=args.dim, n_layers=args.n_layers, n_heads=max(2, args.dim // 64),
                       n_kv_heads=max(1, args.dim // 128), vocab_size=1024, max_seq_len=T)
    H, KV, d = mcfg.n_heads, mcfg.n_kv_heads, mcfg.head_dim
    qkv_dtype = autocast_dtype or torch.float32                 # what the projections hand attention under autocast
    q, k, v = (torch.randn(B, h, T, d, device=dev, dtype=qkv_dtype) for h in (H, KV, KV))
    dense, bm = attention_mask(T, doc_ids=doc, device=dev), document_block_mask(doc)
    amp = lambda: torch.autocast(dev_type, dtype=autocast_dtype, enabled=autocast_dtype is not None)
    models = {}
    for name in ("flex", "sdpa"):
        mcfg_n = ModelConfig(**{**mcfg.__dict__, "attention_backend": name})
        torch.manual_seed(0); models[name] = build_model(mcfg_n).to(dev)
    tokens = torch.randint(0, 1024, (B, T), device=dev)
    labels = torch.randint(0, 1024, (B, T), device=dev)

    with torch.no_grad(), amp():
        sync(dev); t0 = time.perf_counter(); out = flex_gqa(q, k, v, bm)
        sync(dev); compile_s = time.perf_counter() - t0
        diff = (out.float() - sdpa_gqa(q, k, v, dense).float()).abs().max().item()
        for m in models.values(): m(tokens, doc_ids=doc)   # warm-up (the model's flex calls reuse the compiled kernel)
    trains = {}
    for name, m in models.items():
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        def step(m=m, opt=opt):
            with amp(): loss = m(tokens, doc_ids=doc, labels=labels) / labels.numel()
            loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        try: step(); trains[name] = step
        except NotImplementedError as e: trains[name] = str(e)

    res = {f"{what}_{n}": [] for what in ("mask_ms", "attention_ms", "forward_ms", "train_step_ms") for n in models}
    for r in range(args.rounds):
        for name in (["flex", "sdpa"] if r % 2 == 0 else ["sdpa", "flex"]):
            make = ((lambda: document_block_mask(doc)) if name == "flex"
                    else (lambda: attention_mask(T, doc_ids=doc, device=dev)))
            res[f"mask_ms_{name}"].append(1e3 * timed(make, dev, args.steps_per_round))
            with torch.no_grad(), amp():
                f = (lambda: flex_gqa(q, k, v, bm)) if name == "flex" else (lambda: sdpa_gqa(q, k, v, dense))
                res[f"attention_ms_{name}"].append(1e3 * timed(f, dev, args.steps_per_round))
                forward = lambda: models[name](tokens, doc_ids=doc)
                res[f"forward_ms_{name}"].append(1e3 * timed(forward, dev, args.steps_per_round))
            if callable(trains[name]):
                res[f"train_step_ms_{name}"].append(1e3 * timed(trains[name], dev, args.steps_per_round))
    med = {k: round(statistics.median(v), 3) for k, v in res.items() if v}
    for what in ("mask_ms", "attention_ms", "forward_ms", "train_step_ms"):
        a, b = med.get(f"{what}_flex"), med.get(f"{what}_sdpa")
        print(f"{what:14s} flex {a if a is not None else 'n/a':>8} sdpa {b:>8}"
              + (f"  sdpa/flex {b / a:.2f}x" if a else ""))
    result = dict(bench="flex_attention", smoke=args.smoke, backend_compile=args.backend_compile, device=dev,
                  dtype=dtype, threads=torch.get_num_threads(), torch=torch.__version__,
                  shape=dict(batch=B, seq_len=T, dim=args.dim, n_layers=args.n_layers, heads=H, kv_heads=KV, head_dim=d,
                             mean_doc_len=args.doc_len,
                             docs_per_row=round(float((doc.max(-1).values + 1).float().mean()), 1)),
                  flex_compile_s=round(compile_s, 2), max_abs_diff_vs_sdpa=diff, medians=med,
                  ratio_sdpa_over_flex={w: round(med[f"{w}_sdpa"] / med[f"{w}_flex"], 3)
                                        for w in ("mask_ms", "attention_ms", "forward_ms", "train_step_ms")
                                        if f"{w}_flex" in med},
                  flex_training={n: "ok" if callable(t) else t for n, t in trains.items()})
    print(json.dumps(result))


if __name__ == "__main__":
    main()
