"""The legs of `bench/gpu.sh`, one per call: each writes one JSON object to the path it is given. `--smoke` runs the
same code on the CPU at tiny shapes (gloo instead of NCCL, no torch.compile), so CI keeps the script from rotting.

    python bench/gpu_legs.py OUTDIR LEG [LEG ...] [--smoke]   # each leg writes OUTDIR/LEG.json and its line in
                                                              # OUTDIR/legs.jsonl as it ends (legs: see LEGS)
    python bench/gpu_legs.py summary OUTDIR [--smoke]         # one JSON line: every leg, MFU computed one way
    python bench/gpu_legs.py --smoke                          # the one-process legs into a temporary folder, then the
                                                              # summary (fsdp2_124m and gg_train_124m: bash
                                                              # bench/gpu.sh --smoke)

`bench/gpu.sh` runs each leg in a process of its own on a GPU; the CPU smoke run takes several in one process (one
import of torch and the package instead of five).

The environment carries the limits `bench/gpu.sh` sets: `GG_LEG_DEADLINE` (epoch seconds by which the leg's process is
killed: its subprocesses get what is left), `GG_BENCH_DEADLINE` (when several legs share a process: the ones not
started by then are skipped) and `GG_BENCH_EAGER=1` (no C compiler or Python.h, so Triton cannot build: nothing is
compiled).

Every leg that trains or decodes reports `tokens_per_s`, `flops_per_token` and `ranks`; `summary` turns them into MFU
against both the measured matmul peak and the datasheet, the same way for every leg.
"""
from __future__ import annotations
import json, os, statistics, subprocess, sys, time
from pathlib import Path
import torch

SMOKE = "--smoke" in sys.argv
EAGER = SMOKE or os.environ.get("GG_BENCH_EAGER") == "1"
ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=1024",
        "model.max_seq_len=64", "model.multiple_of=32", "training.seq_len=64", "training.micro_batch_size=2"]


def device() -> torch.device: return torch.device("cpu" if SMOKE else "cuda")
def sync(): torch.cuda.synchronize() if not SMOKE else None
def dtype(): return torch.float32 if SMOKE else torch.bfloat16


def config(recipe: str, extra=()):
    "The recipe's config, shrunk to the smoke shapes on CPU."
    from gradient_garden.recipes import load_config
    over = [f"runtime.device={device().type}"]
    if SMOKE: over += [*TINY, "runtime.compile=false", "runtime.precision=fp32"]
    elif EAGER: over += ["runtime.compile=false"]
    return load_config(recipe=str(ROOT/recipe), overrides=over + list(extra))[0]


def leg_peak() -> dict:
    "The best bf16 matmul rate this device reaches (8192^2, or 512^2 fp32 in smoke mode) and its datasheet peak."
    from gradient_garden.hardware import gpu_datasheet_flops, measure_matmul_peak
    n = 512 if SMOKE else 8192
    measured = measure_matmul_peak(device(), n, reps=3 if SMOKE else 20, dtype=dtype())
    name = "cpu" if SMOKE else torch.cuda.get_device_name(0)
    return dict(device=name, matmul_n=n, dtype=str(dtype()).split(".")[1], measured_peak_flops=measured,
                datasheet_peak_flops=None if SMOKE else gpu_datasheet_flops(name, "bf16"))


def time_left(margin: float = 5.0, default: float = 900.0) -> float:
    "Seconds this leg's process has before `bench/gpu.sh` kills it (`GG_LEG_DEADLINE`), less `margin`."
    d = os.environ.get("GG_LEG_DEADLINE")
    return default if not d else float(d) - time.time() - margin


def leg_step(recipe: str, micro: int, float8: str | None = None) -> dict:
    ("Timed training steps (forward, backward, optimizers) of RECIPE's model on random tokens; FSDP2 under torchrun; "
     "`float8`: its Linear layers in float8 (torchao, emulated on CPU).")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from gradient_garden.parallel.distributed import apply_fsdp, grad_sync
    from gradient_garden.train.optim import build_optimizers
    from gradient_garden.models.tendril import count_parameters
    from gradient_garden.models.registry import build_model, flops_per_token
    cfg = config(recipe, [] if EAGER else ["runtime.compile=true"])
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    # started by torchrun: FSDP2 over every rank, even one (NCCL all-gathers for real)
    fsdp = "LOCAL_RANK" in os.environ
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if not SMOKE else device()
    if not SMOKE: torch.cuda.set_device(dev)
    torch.manual_seed(0)
    model = build_model(cfg.model).to(dev)
    if float8:
        from gradient_garden.models.float8 import apply_float8, float8_emulated
        apply_float8(model, float8, emulate=float8_emulated(dev), fsdp_all_gather="LOCAL_RANK" in os.environ)
    if cfg.runtime.compile:
        for block in model.layers: block.compile()
    if fsdp:
        dist.init_process_group("gloo" if SMOKE else "nccl", device_id=None if SMOKE else dev)
        model = apply_fsdp(model, "fp32" if SMOKE else "bf16", init_device_mesh(dev.type, (world,)))
    opts = build_optimizers(model, cfg.optimizers, dev.type)
    T = cfg.training.seq_len
    toks = torch.randint(0, cfg.model.vocab_size, (micro, T + 1), device=dev)
    accum = 2 if SMOKE else max(1, min(8, cfg.training.total_batch_size // (micro * T * world)))
    def step():
        for i in range(accum):
            with grad_sync(model, sync=i == accum - 1), torch.autocast(dev.type, dtype=dtype(), enabled=not SMOKE):
                loss = model(toks[:, :-1], labels=toks[:, 1:]) / (micro * T * accum)
            loss.backward()
        for o in opts: o.step(); o.zero_grad(set_to_none=True)
    step(); step(); sync()                       # compile and warm-up
    if not SMOKE: torch.cuda.reset_peak_memory_stats()
    n = 1 if SMOKE else 5
    t0 = time.perf_counter()
    for _ in range(n): step()
    sync(); dt = time.perf_counter() - t0
    res = dict(recipe=recipe, params=count_parameters(model), ranks=world, fsdp2=fsdp,
               backend=(dist.get_backend() if fsdp else None), micro_batch=micro, seq_len=T, grad_accum=accum,
               compiled=cfg.runtime.compile, float8=float8, tokens_per_s=n * accum * micro * T * world / dt,
               flops_per_token=flops_per_token(cfg.model, T),
               peak_mem_gib=None if SMOKE else round(torch.cuda.max_memory_allocated() / 2**30, 2))
    if fsdp and world == 1: res["note"] = "one rank: FSDP2's collectives are local copies; see the collectives leg"
    if fsdp: dist.destroy_process_group()
    return res if rank == 0 else {}


def leg_train(recipe: str, out_dir: Path) -> dict:
    "A short `gg train` of RECIPE on synthetic shards: loader, accumulation, clipping, logging, validation, checkpoint."
    from gradient_garden.models.registry import flops_per_token
    steps = 6 if SMOKE else 30
    from common import synthetic_pretraining_data
    data = synthetic_pretraining_data(out_dir/"synthetic", 1024, 200_000 if SMOKE else 40_000_000)
    sets = [f"tokenizer.path={data['tokenizer']}", f"paths.datasets={data['datasets']}", f"paths.runs={out_dir/'runs'}",
            f"training.max_steps={steps}", "training.log_every=1", "evals.every=0", "generation.every=0",
            f"validation.every={steps}", "validation.steps=2", f"checkpointing.every={steps}",
            f"runtime.device={device().type}"]
    sets += [*TINY, "runtime.compile=false", "runtime.precision=fp32", "training.total_batch_size=256"] if SMOKE else \
            ["training.total_batch_size=131072"] + ["runtime.compile=false"] * EAGER   # 8 x 16 x 1024 a step
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "gradient_garden.cli", "train", "--recipe", str(ROOT/recipe),
                        "--set", *sets], cwd=ROOT, capture_output=True, text=True, timeout=time_left())
    wall = time.perf_counter() - t0
    if r.returncode != 0: raise RuntimeError(f"gg train failed ({r.returncode}): {r.stderr.strip().splitlines()[-1:]}")
    from gradient_garden.recipes import load_config
    cfg, _ = load_config(recipe=str(ROOT/recipe), overrides=sets)
    rows = [json.loads(l) for l in (cfg.run_dir/"metrics.jsonl").read_text().splitlines()]
    tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["step"] > 2]   # after compilation and warm-up
    t = cfg.training
    return dict(recipe=recipe, steps=steps, ranks=1, grad_accum=t.total_batch_size // (t.micro_batch_size * t.seq_len),
                tokens_per_s=statistics.median(tps), flops_per_token=flops_per_token(cfg.model, cfg.training.seq_len),
                final_loss=rows[-1].get("loss"), val_loss=next((r["val_loss"] for r in rows if "val_loss" in r), None),
                checkpoint=any((cfg.run_dir/"checkpoints").iterdir()), wall_s=round(wall, 1))


def leg_decode() -> dict:
    "Greedy decoding with the KV cache after a 128-token prompt (124M shape, bf16): tokens/s at batch 1 and 32."
    from gradient_garden.models.registry import build_model, flops_per_token
    cfg = config("recipes/pretraining/tendril-124m.yaml")
    model = build_model(cfg.model).to(device(), dtype()).eval()
    prompt_len, new = (16, 8) if SMOKE else (128, 256)
    res = dict(prompt_len=prompt_len, new_tokens=new, ranks=1)
    for b in ((1, 4) if SMOKE else (1, 32)):
        prompt = torch.randint(0, cfg.model.vocab_size, (b, prompt_len), device=device())
        @torch.no_grad()
        def run():
            c = model.new_kv_cache(b, prompt_len + new)
            tok = model(prompt, kv_cache=c, start_pos=0)[:, -1].argmax(-1, keepdim=True)
            for i in range(new - 1):
                tok = model(tok, kv_cache=c, start_pos=prompt_len + i)[:, -1].argmax(-1, keepdim=True)
        run(); sync()
        t0 = time.perf_counter(); run(); sync()
        res[f"batch{b}_tokens_per_s"] = b * new / (time.perf_counter() - t0)
    res["tokens_per_s"] = res[f"batch{b}_tokens_per_s"]                      # the larger batch carries the MFU
    # a forward only: a third of training's
    res["flops_per_token"] = flops_per_token(cfg.model, prompt_len + new // 2) / 3
    return res


def leg_attention() -> dict:
    "Causal SDPA (Flash kernel on CUDA) forward + backward at the 124M attention shape; flex vs SDPA, packed documents."
    B, H, T, D = (2, 4, 64, 16) if SMOKE else (16, 12, 1024, 64)
    q, k, v = (torch.randn(B, H, T, D, device=device(), dtype=dtype(), requires_grad=True) for _ in range(3))
    def run():
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True); o.sum().backward()
    for _ in range(3): run()
    sync(); n = 3 if SMOKE else 20
    t0 = time.perf_counter()
    for _ in range(n): run()
    sync(); dt = (time.perf_counter() - t0) / n
    res = dict(shape=[B, H, T, D], ranks=1, tokens_per_s=B * T / dt,
               flops_per_token=3.5 * 2 * 2 * H * D * T / 2)   # QK^T and PV, causal half; backward 2.5x the forward
    budget = time_left(10)   # the flex run gets what the leg has left, so the SDPA result above is never lost
    if SMOKE: res["flex_vs_sdpa"] = "skipped: torch has no flex_attention backward on CPU"
    elif EAGER: res["flex_vs_sdpa"] = "skipped: flex_attention needs Triton, which needs a C compiler and Python.h"
    elif budget < 30: res["flex_vs_sdpa"] = f"skipped: {budget:.0f}s left in the leg"
    else:
        cmd = [sys.executable, str(ROOT/"bench/flex_attention.py"), "--device", "cuda", "--dtype", "bf16",
               "--batch-size", "16", "--seq-len", "2048", "--dim", "768", "--n-layers", "12", "--doc-len", "300"]
        try: r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=budget)
        except subprocess.TimeoutExpired:
            res["flex_vs_sdpa"] = {"error": f"timed out after {budget:.0f}s (the leg's cap)"}; return res
        res["flex_vs_sdpa"] = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else \
            {"error": (r.stderr.strip().splitlines() or ["failed"])[-1][:300]}
    return res


def leg_rl() -> dict:
    """RL steps of the rl stage's own loader and loss at the 124M shape (random weights, plain prompts, bf16 autocast):
    32 prompts x G 8 sampled with the KV cache up to 64 new tokens, rewarded, then one AdamW step over the 256 rows.
    `tokens_per_s` / `flops_per_token` are the update's (its MFU); rollouts are reported apart, as the stage logs
    them."""
    from types import SimpleNamespace
    from gradient_garden.config import RLConfig
    from gradient_garden.models.registry import build_model, flops_per_token
    from gradient_garden.runtime import autocast_context
    from gradient_garden.evals.verifiers import Problem
    from gradient_garden.stages.rl import RLTask
    from gradient_garden.stages.rl_rollouts import RolloutLoader
    cfg = config("recipes/pretraining/tendril-124m.yaml")
    P, G, M, seq, steps = (4, 4, 8, 32, 2) if SMOKE else (32, 8, 64, 128, 3)
    precision = "fp32" if SMOKE else "bf16"
    torch.manual_seed(0)
    model = build_model(cfg.model).to(device())
    tok = SimpleNamespace(eot_id=2, eos_id=None, pad_id=0,
                          encode=lambda s, bos=False: [1] * bos + [3 + ord(c) % 500 for c in s],
                          decode=lambda ids: "".join(chr(97 + i % 26) for i in ids))
    exs = [Problem("custom", "bench", "Q " + "w" * (i % 7) + f" {i}", "") for i in range(P * (steps + 1))]
    rl = RLConfig(group_size=G, loss_type="dapo", temperature=1.0, max_new_tokens=M, plain_prompts=True)
    reward = lambda ex, text, stopped: {"total": float(text.count("a") % 2)}
    loader = RolloutLoader(model, tok, exs, rl, reward, seq, P * G, 1, seed=0, precision=precision)
    task, opt = RLTask(rl), torch.optim.AdamW(model.parameters(), lr=1e-5)
    times, rollout, new_tokens, update_tokens = [], [], 0, 0
    for step in range(steps + 1):
        sync(); t0 = time.perf_counter()
        b = loader.next_batch(); sync(); t1 = time.perf_counter()
        b = {k: v.to(device()) if torch.is_tensor(v) else v for k, v in b.items()}
        with autocast_context(device(), precision): loss_sum, _ = task.loss(model, b)
        (loss_sum / task.count(b).to(loss_sum.device)).backward()
        opt.step(); opt.zero_grad(set_to_none=True); sync()
        if step:
            times.append(time.perf_counter() - t0); rollout.append(t1 - t0)
            new_tokens += int((b["labels"] != -100).sum()); update_tokens += b["input_ids"].numel()
    step_s, roll_s = sum(times), sum(rollout)
    return dict(prompts=P, group=G, max_new_tokens=M, ranks=1, steps=steps, completions_per_s=P * G * steps / step_s,
                rollout_share=round(roll_s / step_s, 3), rollout_tokens_per_s=new_tokens / roll_s,
                tokens_per_s=update_tokens / (step_s - roll_s), flops_per_token=flops_per_token(cfg.model, seq),
                step_s=round(statistics.median(times), 4))


def leg_collectives() -> dict:
    """All-reduce between processes started by torchrun: the latency of a one-float all-reduce (the size of a per-step
    agreement) and the bus bandwidth at 1, 16 and 64 MiB. On several GPUs: NCCL, one rank per GPU. On one GPU NCCL
    cannot run two ranks (it refuses two ranks on one device: "Duplicate GPU detected"), and a world of one sends
    nothing (FSDP2's all-gathers become local copies), so two ranks share the GPU over gloo: CUDA tensors staged
    through host memory and TCP, which is real inter-process traffic and the path every gloo group takes."""
    import torch.distributed as dist
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    nccl = not SMOKE and world > 1 and torch.cuda.device_count() >= world
    dev = device() if SMOKE else torch.device("cuda", int(os.environ["LOCAL_RANK"]) if nccl else 0)
    if not SMOKE: torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if nccl else "gloo", device_id=dev if nccl else None)
    def timed(x, reps):
        for _ in range(2): dist.all_reduce(x)
        sync(); dist.barrier(); t0 = time.perf_counter()
        for _ in range(reps): dist.all_reduce(x)
        sync(); return (time.perf_counter() - t0) / reps
    one = timed(torch.ones(1, device=dev), 5 if SMOKE else 50)
    rows = []
    for mib in ((1 / 64, 1 / 4) if SMOKE else (1, 16, 64)):
        n = int(mib * 2**20)
        dt = timed(torch.ones(n // 4, device=dev), 2 if SMOKE else 10)
        rows.append(dict(mib=mib, ms=round(dt * 1e3, 3), bus_gb_s=round(2 * (world - 1) / world * n / dt / 1e9, 3)))
    dist.destroy_process_group()
    return dict(backend="nccl" if nccl else "gloo", ranks=world, gpus=0 if SMOKE else torch.cuda.device_count(),
                tensors_on=dev.type, one_float_all_reduce_us=round(one * 1e6, 1), all_reduce=rows) if rank == 0 else {}


LEGS = ["peak", "train_124m", "train_400m", "float8_124m", "float8_400m", "collectives", "fsdp2_124m",
        "gg_train_124m", "decode", "attention", "rl_124m"]

def summary(out_dir: Path) -> dict:
    "Every leg's JSON (or its error) in one object; MFU = tokens/s x FLOPs/token / (peak x ranks), for both peaks."
    res = {"smoke": SMOKE, "torch": torch.__version__, "install": (out_dir/"install.txt").read_text().strip()
           if (out_dir/"install.txt").exists() else None}
    for leg in LEGS:
        p = out_dir/f"{leg}.json"
        try: res[leg] = json.loads(p.read_text())
        except Exception: res[leg] = {"error": "no result"}
    notes = out_dir/"notes.txt"   # what bench/gpu.sh said: the torch chosen, eager or compiled, legs skipped
    if notes.exists(): res["notes"] = notes.read_text().strip().splitlines()
    for leg in LEGS:
        log = next((p for p in (out_dir/f"{leg}.log", out_dir/"single.log") if p.exists()), None)
        if "error" in res[leg] and log is not None: res[leg]["log_tail"] = log.read_text().strip().splitlines()[-3:]
    peak = res["peak"]
    for leg in LEGS[1:]:
        r = res[leg]
        if "tokens_per_s" in r and "flops_per_token" in r:
            achieved = r["tokens_per_s"] * r["flops_per_token"] / r.get("ranks", 1)
            for key, name in (("measured_peak_flops", "mfu_measured_peak"), ("datasheet_peak_flops", "mfu_datasheet")):
                r[name] = round(achieved / peak[key], 4) if peak.get(key) else None
    for size in ("124m", "400m"):   # float8 against bf16: the same model, micro batch and steps
        f8, bf16 = res[f"float8_{size}"], res[f"train_{size}"]
        if "tokens_per_s" in f8 and "tokens_per_s" in bf16:
            f8["speedup_vs_bf16"] = round(f8["tokens_per_s"] / bf16["tokens_per_s"], 3)
    return res


def record(out_dir: Path, leg: str, res: dict):
    "Write LEG.json, then append its line to legs.jsonl (one write, flushed: a later kill leaves it whole)."
    (out_dir/f"{leg}.json").write_text(json.dumps(res))
    fd = os.open(out_dir/"legs.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try: os.write(fd, (json.dumps({"leg": leg} | res) + "\n").encode()); os.fsync(fd)
    finally: os.close(fd)


def run_leg(leg: str, out: Path) -> dict:
    "Run one leg by its name in `LEGS` (the step legs take their recipe from the name); its result or its error."
    try:
        if leg == "peak": return leg_peak()
        if leg == "collectives": return leg_collectives()
        if leg in ("train_124m", "train_400m", "fsdp2_124m"):
            return leg_step(f"recipes/pretraining/tendril-{leg.split('_')[-1]}.yaml", 16)
        if leg in ("float8_124m", "float8_400m"):   # tensorwise: the recipe FSDP2 can all-gather in float8
            return leg_step(f"recipes/pretraining/tendril-{leg.split('_')[-1]}.yaml", 16, float8="tensorwise")
        if leg == "gg_train_124m": return leg_train("recipes/pretraining/tendril-124m.yaml", out.parent)
        return {"decode": leg_decode, "attention": leg_attention, "rl_124m": leg_rl}[leg]()
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"}


# what `--smoke` alone runs
ONE_PROCESS = ["peak", "train_124m", "train_400m", "float8_124m", "float8_400m", "decode", "attention", "rl_124m"]

if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--smoke"]
    if not args and SMOKE:   # the legs one process can run, then the summary: the script's own smoke run
        import tempfile
        out_dir = Path(tempfile.mkdtemp(prefix="gg_smoke_gpu_legs_"))
        for leg in ("collectives", "fsdp2_124m", "gg_train_124m"):
            skipped = {"skipped": "torchrun / gg train: run by bash bench/gpu.sh --smoke"}
            (out_dir/f"{leg}.json").write_text(json.dumps(skipped))
        args = [str(out_dir), *ONE_PROCESS]
    elif not args:
        sys.exit("usage: python bench/gpu_legs.py OUTDIR LEG [LEG ...] [--smoke] | summary OUTDIR [--smoke] | --smoke")
    if args[0] == "summary": print(json.dumps(summary(Path(args[1])))); sys.exit(0)
    out_dir, legs = Path(args[0]), args[1:]   # several legs in one process: one import of torch and the package
    until = float(os.environ.get("GG_BENCH_DEADLINE", "inf"))
    for leg in legs:
        t0 = time.perf_counter()
        if time.time() >= until: res = {"skipped": "the deadline passed before it started"}
        else:
            res = run_leg(leg, out_dir/f"{leg}.json")
            if res: res |= {"leg_s": round(time.perf_counter() - t0, 1)}
        if res: record(out_dir, leg, res)
    if not sys.argv[1:] or sys.argv[1:] == ["--smoke"]: print(json.dumps(summary(out_dir)))
