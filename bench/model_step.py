"""Training-step throughput: Tendril (eager and torch.compile) vs transformers' LlamaForCausalLM, same weights.

One step = forward with each model's own training loss + backward + AdamW step, on a fixed batch: Tendril's
`model(x, labels=y)` (the fused, chunked head + cross-entropy that training uses) and Llama's
`model(input_ids=x, labels=y, shift_labels=y).loss` (logits, then transformers' cross-entropy). `tendril_logits`
is Tendril with the Llama-style loss (logits, then `F.cross_entropy`), to show what the fused loss adds. The
contenders run side by side in one process, in alternating (rotated) order each round; figures are medians over
rounds. Peak memory comes from a fresh child process per contender on CPU (growth of its peak RSS, VmHWM) and from
the CUDA allocator on GPU.
MFU = flops_per_token x tokens/s / peak, against the matmul peak measured here (and the datasheet peak on GPU).

    python bench/model_step.py                       # CPU fp32, the issue's shape
    python bench/model_step.py --dtype bf16                        # CPU bf16 autocast, with an fp32 Tendril beside it
    python bench/model_step.py --device cuda --dtype bf16 --batch-size 32 --seq-len 1024
    git worktree add /tmp/base <commit> && python bench/model_step.py --no-compile --no-memory --against /tmp/base
    python bench/model_step.py --smoke               # dim 64, 2 layers, 1 x 32 tokens, one round, no torch.compile

With `--against DIR`, `tendril_against` is the Tendril of another checkout of the project (an earlier commit, say),
imported beside this one in the same process, given the same weights (fused projections split where it keeps them
apart), and timed in the same rotation: a change's speed measured side by side, under the same load.

With `--dtype bf16`, `tendril_fp32` (the same model without autocast) runs beside the bf16 contenders, so the bf16
speed-up is measured side by side; its MFU is quoted against the fp32 peak, the others' against the bf16 peak. On CPU
bf16 training attends by the kernel `models.attention.train_attention_kernel` measured on this machine (printed as
`dispatch bf16_train_attention@...`, with the timings behind it); `tendril_block` and `tendril_sdpa` are the same model
held to `BlockAttentionFunction` and to PyTorch's SDPA (flash) kernel in bf16. Every contender is timed the same way:
forward with its loss, backward, fused AdamW step and `zero_grad`, under the same autocast.

The last line of stdout is one JSON object with the figures.
"""
from __future__ import annotations
import argparse, copy, gc, json, os, statistics, subprocess, sys, time
import torch
from gradient_garden.hardware import gpu_datasheet_flops
from common import apply_smoke, bench_parser, matmul_peak_flops, setup, sync
import torch.nn.functional as F

from gradient_garden.config import ModelConfig
from gradient_garden.models.tendril import Tendril, count_parameters, ffn_hidden_dim
from gradient_garden.models.registry import flops_per_token
from gradient_garden.checkpoint.hf import to_hf_model
import gradient_garden.models.attention as attention
from gradient_garden.runtime import dispatch_choices
MEASURED_KERNEL = attention.train_attention_kernel
FORCED_KERNEL = {"tendril_block": "block", "tendril_sdpa": "sdpa"}   # bf16 CPU training contenders on one kernel

def use_attention_of(name: str):
    "`tendril_block` / `tendril_sdpa` attend by that kernel in bf16 CPU training; the others by the measured choice."
    forced = FORCED_KERNEL.get(name)
    attention.train_attention_kernel = MEASURED_KERNEL if forced is None else \
        (lambda q, k, mask: forced if MEASURED_KERNEL(q, k, mask) else None)


def parse_args(argv=None):
    p = bench_parser(__doc__, rounds=12, steps_per_round=2, warmup=3)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile contender")
    p.add_argument("--compile-llama", action="store_true", help="also time LlamaForCausalLM under torch.compile")
    p.add_argument("--compile-mode", default="model", choices=["model", "blocks"],
                   help="torch.compile the whole model, or each block in place (as runtime.compile does in training)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    p.add_argument("--loss-impl", default="auto", choices=["auto", "eager", "compiled", "liger"],
                   help="the fused loss of the tendril contenders "
                        "(auto: eager on CPU, Liger or compiled chunks on CUDA)")
    p.add_argument("--against", default=None, help="another checkout of the project: time its Tendril beside this one")
    p.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    return apply_smoke(p.parse_args(argv), batch_size=1, seq_len=32, rounds=1, steps_per_round=1, warmup=1,
                       no_compile=True)

def model_config(args) -> ModelConfig:
    "The issue's shape: dim 256, 4 layers, 8 / 4 KV heads, SwiGLU 768, vocab 8192, untied (smoke: dim 64, 2 layers)."
    if args.smoke: return ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=1024, multiple_of=64,
                                      max_seq_len=max(64, args.seq_len), tie_embeddings=False)
    return ModelConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=8192, multiple_of=256,
                       max_seq_len=max(256, args.seq_len), tie_embeddings=False)

def other_tendril(path: str, cfg: ModelConfig, base: torch.nn.Module) -> torch.nn.Module:
    "The Tendril of the checkout at `path` (its own package, imported beside this one) with `base`'s weights."
    ours = {k: sys.modules.pop(k) for k in list(sys.modules) if k.split(".")[0] == "gradient_garden"}
    sys.path.insert(0, str(path))
    try:
        from gradient_garden.config import ModelConfig as OtherConfig
        from gradient_garden.models.tendril import Tendril as OtherTendril
        if not sys.modules["gradient_garden"].__file__.startswith(os.path.abspath(path)):
            raise SystemExit(f"--against: {path}: no gradient_garden there")
        model = OtherTendril(OtherConfig(**{k: getattr(cfg, k) for k in OtherConfig.__dataclass_fields__}))
    finally:   # its modules stay alive through the objects that use them; ours come back under the package's name
        sys.path.remove(str(path))
        for k in [k for k in sys.modules if k.split(".")[0] == "gradient_garden"]: del sys.modules[k]
        sys.modules.update(ours)
    from gradient_garden.checkpoint.state_dict import StateDictAdapter
    sd = base.state_dict()
    if "layers.0.attention.wqkv.weight" not in model.state_dict(): sd = StateDictAdapter(base).split(sd)
    model.load_state_dict(sd)
    return model

def make_contenders(cfg, args, names):
    "name -> (model, optimizer); all start from the same weights."
    torch.manual_seed(0)
    base = Tendril(cfg).to(args.device)
    out = {}
    for name in names:
        if name == "tendril_against": m = other_tendril(args.against, cfg, base).to(args.device)
        elif name.startswith("tendril"): m = copy.deepcopy(base)
        else: m = to_hf_model(base).to(args.device).train()
        m.train()
        fwd = m
        if name.endswith("compiled"):
            if args.compile_mode == "model": fwd = torch.compile(m)
            else:
                for block in (m.layers if name.startswith("tendril") else m.model.layers): block.compile()
        fused = args.device != "mps"
        out[name] = (fwd, torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.1, fused=fused))
    return out

def make_batch(cfg, args):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), generator=g).to(args.device)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()

def step(model, opt, x, y, autocast_dtype, device_type, own_loss=True):
    "Forward with the model's own loss (or logits then `F.cross_entropy`), backward, AdamW; returns the mean loss."
    tendril = getattr(getattr(model, "_orig_mod", model), "loss_from_labels", False)
    with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        if own_loss and tendril: loss = model(x, labels=y) / y.numel()
        elif own_loss: loss = model(input_ids=x, labels=y, shift_labels=y).loss
        else:
            out = model(x) if tendril else model(input_ids=x).logits
            loss = F.cross_entropy(out.flatten(0, 1).float(), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()

def rss_mb() -> float:
    "Resident memory of this process now (MB)."
    with open("/proc/self/statm") as f: return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

def peak_rss_mb() -> float:
    "High-water mark of this process's resident memory (MB); unlike ru_maxrss it is not inherited across exec."
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) / 1024

def memory_child(args):
    "Peak RSS growth (MB) of building and training one contender for a few steps, in this fresh process."
    cfg = model_config(args)
    base = rss_mb()
    name = args.memory_child
    if name.startswith("tendril"): model = Tendril(cfg)
    else:
        from transformers import LlamaForCausalLM
        from gradient_garden.models.hf import hf_config
        model = LlamaForCausalLM(hf_config(cfg))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    if name.endswith("compiled"):
        if args.compile_mode == "model": model = torch.compile(model)
        else:
            for block in (model.layers if name.startswith("tendril") else model.model.layers): block.compile()
    x, y = make_batch(cfg, args)
    ad = torch.bfloat16 if args.dtype == "bf16" and not name.endswith("_fp32") else None
    use_attention_of(name)
    for _ in range(3): step(model, opt, x, y, ad, "cpu", own_loss=not name.endswith("_logits"))
    print(json.dumps({"peak_mb": peak_rss_mb() - base}))

def peak_memory_mb(name, args, contenders, x, y, autocast_dtype, dev_type):
    if args.device.startswith("cuda"):   # the other contenders' weights stay resident: count only this one's
        model, opt = contenders[name]
        gc.collect(); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        own = sum(t.numel() * t.element_size() for t in list(model.parameters()) +
                  [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.is_cuda])
        step(model, opt, x, y, autocast_dtype, dev_type, own_loss=not name.endswith("_logits")); sync(args.device)
        return (torch.cuda.max_memory_allocated() - before + own) / 2**20
    cmd = [sys.executable, __file__, "--memory-child", name, "--batch-size", str(args.batch_size),
           "--seq-len", str(args.seq_len)]
    if args.threads: cmd += ["--threads", str(args.threads)]
    cmd += ["--compile-mode", args.compile_mode] + (["--dtype", args.dtype] if args.dtype else [])
    cmd += ["--smoke"] * args.smoke
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode: raise RuntimeError(res.stderr[-2000:])
    return json.loads(res.stdout.strip().splitlines()[-1])["peak_mb"]

def main(argv=None):
    args = parse_args(argv)
    if args.threads: torch.set_num_threads(args.threads)
    if args.memory_child: return memory_child(args)
    dev_type, dtype, autocast_dtype = setup(args)
    cfg = model_config(args)
    import gradient_garden.models.tendril as tendril_module
    if hasattr(tendril_module, "LOSS_IMPL"): tendril_module.LOSS_IMPL = args.loss_impl
    names = ["tendril", "tendril_logits", "llama"] + ([] if args.no_compile else ["tendril_compiled"])
    if args.compile_llama: names.append("llama_compiled")
    if dtype != "fp32": names.append("tendril_fp32")
    if dtype == "bf16" and dev_type == "cpu": names[1:1] = ["tendril_block", "tendril_sdpa"]
    if args.against: names.insert(1, "tendril_against")
    dtype_of = lambda n: None if n.endswith("_fp32") else autocast_dtype   # the contender's autocast dtype
    contenders = make_contenders(cfg, args, names)
    x, y = make_batch(cfg, args)
    tokens = x.numel()

    first = {}
    for n, (m, o) in contenders.items():       # warm-up (and compilation); first losses must agree: same weights
        t = time.perf_counter()
        use_attention_of(n)
        for i in range(args.warmup):
            loss = step(m, o, x, y, dtype_of(n), dev_type, own_loss=not n.endswith("_logits"))
            if i == 0: first[n] = loss.item()
        sync(args.device)
        print(f"warm-up {n}: {time.perf_counter() - t:.1f}s, first loss {first[n]:.5f}", flush=True)

    times, cpu_times = {n: [] for n in names}, {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            m, o = contenders[n]
            use_attention_of(n)
            sync(args.device); t, c = time.perf_counter(), time.process_time()
            for _ in range(args.steps_per_round):
                step(m, o, x, y, dtype_of(n), dev_type, own_loss=not n.endswith("_logits"))
            sync(args.device)
            times[n].append((time.perf_counter() - t) / args.steps_per_round)
            cpu_times[n].append((time.process_time() - c) / args.steps_per_round)
    med = {n: statistics.median(v) for n, v in times.items()}
    cpu_med = {n: statistics.median(v) for n, v in cpu_times.items()}
    tps = {n: tokens / t for n, t in med.items()}

    peak_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    peak = matmul_peak_flops(args.device, peak_dtype, args.smoke)
    peak_fp32 = peak if dtype == "fp32" else matmul_peak_flops(args.device, torch.float32, args.smoke)
    fpt = flops_per_token(cfg, args.seq_len)
    mfu = {n: fpt * v / (peak_fp32 if n.endswith("_fp32") else peak) for n, v in tps.items()}
    datasheet = None
    if dev_type == "cuda":
        datasheet = gpu_datasheet_flops(torch.cuda.get_device_name(), dtype)
    mem = {} if args.no_memory else {n: peak_memory_mb(n, args, contenders, x, y, dtype_of(n), dev_type) for n in names
                                     if n != "tendril_against"}   # a child process builds this checkout's models only

    print(f"\n{'contender':18s} {'step ms':>9s} {'tokens/s':>10s} {'vs llama':>9s} {'MFU':>7s} {'peak MB':>8s} "
          f"{'cpu ms':>8s} {'vs llama':>9s}  (IQR ms)")
    for n in names:
        q = statistics.quantiles(times[n], n=4) if len(times[n]) > 1 else [med[n]] * 3
        print(f"{n:18s} {med[n]*1e3:9.1f} {tps[n]:10.0f} {tps[n]/tps['llama']:8.2f}x {mfu[n]*100:6.2f}% "
              f"{mem.get(n, float('nan')):8.0f} {cpu_med[n]*1e3:8.1f} {cpu_med['llama']/cpu_med[n]:8.2f}x  "
              f"({q[0]*1e3:.0f}-{q[2]*1e3:.0f})")
    print("fastest step (a quiet-machine estimate): "
          + ", ".join(f"{n} {min(v)*1e3:.0f} ms ({min(times['llama'])/min(v):.2f}x)" for n, v in times.items()))
    print(f"params {count_parameters(contenders['tendril'][0]):,}; {fpt/1e6:.1f} MFLOP/token; "
          f"measured {dtype} matmul peak {peak/1e12:.3f} TFLOP/s"
          + (f" (fp32 {peak_fp32/1e12:.3f})" if dtype != "fp32" else "")
          + (f"; datasheet {datasheet/1e12:.0f}" if datasheet else ""))
    choices = dispatch_choices()
    for name, c in choices.items():
        if name != "machine": print(f"dispatch {name} = {c['value']} ({c['why']}; on {choices['machine']})")
    against = None
    if args.against:   # per-round ratios: each round times both under the same load
        paired = lambda t: statistics.median(a / b for a, b in zip(t["tendril"], t["tendril_against"]))
        against = dict(path=args.against, step_ratio=round(paired(times), 3),
                       cpu_step_ratio=round(paired(cpu_times), 3))
        print(f"tendril / tendril_against ({args.against}), median of per-round ratios: "
              f"wall {against['step_ratio']:.3f}, CPU time {against['cpu_step_ratio']:.3f}")
    if "tendril_fp32" in names:
        print("vs tendril_fp32 (median step): "
              + ", ".join(f"{n} {med['tendril_fp32']/med[n]:.2f}x" for n in names if n != "tendril_fp32"))
    result = dict(bench="model_step", smoke=args.smoke, device=args.device, dispatch=choices,
                  device_name=torch.cuda.get_device_name() if dev_type == "cuda" else "cpu",
                  threads=torch.get_num_threads(), dtype=dtype, torch=torch.__version__,
                  shape=dict(dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                             hidden=ffn_hidden_dim(cfg.dim, cfg.multiple_of), vocab=cfg.vocab_size,
                             seq_len=args.seq_len, batch_size=args.batch_size),
                  rounds=args.rounds, steps_per_round=args.steps_per_round, compile_mode=args.compile_mode,
                  step_ms={n: round(v * 1e3, 2) for n, v in med.items()},
                  step_ms_min={n: round(min(v) * 1e3, 2) for n, v in times.items()},
                  ratio_vs_llama_min={n: round(min(times["llama"]) / min(v), 3) for n, v in times.items()},
                  step_cpu_ms={n: round(v * 1e3, 2) for n, v in cpu_med.items()},
                  ratio_vs_llama_cpu_time={n: round(cpu_med["llama"] / v, 3) for n, v in cpu_med.items()},
                  tokens_per_s={n: round(v, 1) for n, v in tps.items()},
                  ratio_vs_llama={n: round(v / tps["llama"], 3) for n, v in tps.items()},
                  mfu={n: round(v, 4) for n, v in mfu.items()},
                  mfu_datasheet={n: round(fpt * v / datasheet, 4) for n, v in tps.items()} if datasheet else None,
                  matmul_peak_tflops=round(peak / 1e12, 4), matmul_peak_fp32_tflops=round(peak_fp32 / 1e12, 4),
                  flops_per_token=fpt,
                  ratio_vs_tendril_fp32=({n: round(med["tendril_fp32"] / v, 3) for n, v in med.items()}
                                         if "tendril_fp32" in med else None),
                  peak_memory_mb={n: round(v, 1) for n, v in mem.items()},
                  first_loss=first, first_loss_max_diff=max(first.values()) - min(first.values()), against=against)
    print(json.dumps(result))

if __name__ == "__main__":
    main()
