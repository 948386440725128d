"""Training-step throughput: TendrilMoE vs a dense Tendril with the same active parameters.

The dense model has the SwiGLU hidden size k x expert hidden (default 2 x 384 = 768, the shape of
bench/model_step.py), so both multiply every token by the same number of feed-forward weights; the MoE holds
n_experts / k times as many. One step = forward + cross-entropy (+ the MoE's aux loss) + backward + AdamW, on a
fixed batch. Contenders run side by side in one process in rotated order each round; figures are medians.

    OMP_NUM_THREADS=1 python bench/moe_step.py               # CPU fp32
    python bench/moe_step.py --smoke                         # tiny batch, one round: seconds
    python bench/moe_step.py --device cuda --dtype bf16 --batch-size 32 --seq-len 1024

The last line of stdout is one JSON object with the figures (ratio = MoE tokens/s / dense tokens/s; target >= 0.7).
"""
from __future__ import annotations
import dataclasses, json, statistics, time
import torch
from common import apply_smoke, bench_parser, setup, sync

from gradient_garden.config import ModelConfig
from gradient_garden.models.tendril import count_parameters, ffn_hidden_dim
from gradient_garden.models.registry import build_model, flops_per_token
from gradient_garden.models.moe import moe_active_matmul_params


def parse_args(argv=None):
    p = bench_parser(__doc__, rounds=8, steps_per_round=2, warmup=2)
    p.add_argument("--n-experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=1.25,
                   help="also time the capacity (padded bmm) path; 0 = skip")
    return apply_smoke(p.parse_args(argv), batch_size=1, seq_len=32, rounds=1, steps_per_round=1, warmup=1)


def configs(args) -> dict[str, ModelConfig]:
    "Dense Tendril (hidden 768) and TendrilMoE (experts of hidden 768 / k), with the same attention, head, active FFN."
    base = ModelConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=8192,
                       max_seq_len=max(256, args.seq_len))
    dense_hidden = 768
    expert_hidden = dense_hidden // args.top_k
    dense = dataclasses.replace(base, architecture="tendril", multiple_of=dense_hidden)
    moe = dataclasses.replace(base, architecture="tendril_moe", multiple_of=expert_hidden,
                              ffn_dim_multiplier=expert_hidden / 682, n_experts=args.n_experts,
                              n_experts_per_token=args.top_k)
    assert ffn_hidden_dim(dense.dim, dense.multiple_of) == dense_hidden
    assert ffn_hidden_dim(moe.dim, moe.multiple_of, moe.ffn_dim_multiplier) == expert_hidden
    out = {"dense": dense, "moe": moe}
    if args.capacity_factor:
        out[f"moe_cap{args.capacity_factor:g}"] = dataclasses.replace(moe, capacity_factor=args.capacity_factor)
    return out


def step(model, opt, x, y, autocast_dtype, device_type):
    "Forward with the model's own (fused) loss (+ aux loss when the model has one), backward, AdamW; returns the loss."
    with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        loss = model(x, labels=y) / y.numel()
    aux = model.aux_loss()   # the router's losses of this forward; None for the dense model
    (loss if aux is None else loss + aux).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def main(argv=None):
    args = parse_args(argv)
    dev_type, dtype, autocast_dtype = setup(args)
    cfgs = configs(args)
    contenders = {}
    for name, cfg in cfgs.items():
        torch.manual_seed(0)
        m = build_model(cfg).to(args.device).train()
        contenders[name] = (m, torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.1, foreach=True))
    g = torch.Generator().manual_seed(1)
    xy = torch.randint(0, 8192, (args.batch_size, args.seq_len + 1), generator=g).to(args.device)
    x, y = xy[:, :-1], xy[:, 1:]
    tokens = x.numel()
    names = list(contenders)
    for n, (m, o) in contenders.items():
        t = time.perf_counter()
        for _ in range(args.warmup): step(m, o, x, y, autocast_dtype, dev_type)
        sync(args.device)
        print(f"warm-up {n}: {time.perf_counter() - t:.1f}s", flush=True)
    times = {n: [] for n in names}
    for r in range(args.rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            m, o = contenders[n]
            sync(args.device); t = time.perf_counter()
            for _ in range(args.steps_per_round): step(m, o, x, y, autocast_dtype, dev_type)
            sync(args.device)
            times[n].append((time.perf_counter() - t) / args.steps_per_round)
    med = {n: statistics.median(v) for n, v in times.items()}
    tps = {n: tokens / t for n, t in med.items()}
    params = {n: count_parameters(m) for n, (m, _) in contenders.items()}
    fpt = {n: flops_per_token(cfgs[n], args.seq_len) for n in names}
    print(f"\n{'contender':14s} {'step ms':>9s} {'tokens/s':>10s} {'vs dense':>9s} {'params':>11s} "
          f"{'GFLOP/token':>12s}  (IQR ms)")
    for n in names:
        q = statistics.quantiles(times[n], n=4) if len(times[n]) > 1 else [med[n]] * 3
        print(f"{n:14s} {med[n]*1e3:9.1f} {tps[n]:10.0f} {tps[n]/tps['dense']:8.2f}x {params[n]:11,d} "
              f"{fpt[n]/1e9:12.4f}  ({q[0]*1e3:.0f}-{q[2]*1e3:.0f})")
    moe = cfgs["moe"]
    result = dict(bench="moe_step", smoke=args.smoke, device=args.device, threads=torch.get_num_threads(), dtype=dtype,
                  torch=torch.__version__,
                  shape=dict(dim=moe.dim, n_layers=moe.n_layers, vocab=moe.vocab_size, seq_len=args.seq_len,
                             batch_size=args.batch_size, n_experts=moe.n_experts, top_k=moe.n_experts_per_token,
                             expert_hidden=768 // args.top_k, dense_hidden=768,
                             active_ffn_params_per_layer=moe_active_matmul_params(moe) - moe.dim * moe.n_experts),
                  rounds=args.rounds, steps_per_round=args.steps_per_round,
                  step_ms={n: round(v * 1e3, 2) for n, v in med.items()},
                  tokens_per_s={n: round(v, 1) for n, v in tps.items()},
                  ratio_vs_dense={n: round(v / tps["dense"], 3) for n, v in tps.items()},
                  params=params, flops_per_token=fpt, target_ratio=0.7,
                  meets_target=tps["moe"] / tps["dense"] >= 0.7)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
