"""Tendril `generate` against transformers' `generate` on several checkouts of this code, side by side in one run.

Each checkout (a folder holding `gradient_garden/`, e.g. one made by `git worktree add /tmp/old <commit>`) is timed
in fresh worker processes that alternate with the other checkouts' workers, so machine load falls on all of them
alike. A worker builds the `bench/generate.py` model (seed 0, dim 256, 4 layers, vocab 8192), its transformers twin,
and 8 left-padded prompts of 16-64 tokens, then times both decoders alternately for `--rounds` batches of 64 greedy
tokens. Reported per checkout: medians (CPU time by default: wall time is meaningless on a loaded machine), the
ratio to transformers, and the share of greedy tokens that agree.

    python bench/generate_versions.py . /tmp/old --reps 2 --rounds 4 --threads 1 [--dtype bf16]
    python bench/generate_versions.py --smoke        # this checkout alone, one worker, one round of 2 rows x 4 tokens

`--dtype bf16` decodes as `bench/generate.py --dtype bf16` does: our fp32 model under `torch.autocast(bf16)`, the
transformers twin in bf16 weights.

The last line of stdout is one JSON object with the figures.
"""
from __future__ import annotations
import argparse, json, os, statistics, subprocess, sys, time

def worker(root: str, rounds: int, threads: int, clock: str, dtype: str = "fp32", smoke: bool = False):
    "Time one checkout (run in its own process with `root` first on sys.path); print a JSON line."
    sys.path.insert(0, root)
    import torch
    torch.set_num_threads(threads)
    import gradient_garden
    from gradient_garden.config import ModelConfig
    from gradient_garden.generation import generate
    from gradient_garden.models.tendril import Tendril
    try: from gradient_garden.checkpoint.hf import to_hf_model
    except ImportError: from gradient_garden.models.hf import to_hf_model   # checkouts before checkpoint/ existed
    assert os.path.realpath(gradient_garden.__file__).startswith(os.path.realpath(root)), gradient_garden.__file__
    B, n_new = (2, 4) if smoke else (8, 64)
    cfg = ModelConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=8192, multiple_of=256, max_seq_len=128,
                      tie_embeddings=False)
    if smoke: cfg = ModelConfig(**{**cfg.__dict__, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                                   "multiple_of": 64})
    torch.manual_seed(0)
    model = Tendril(cfg).eval()
    hf = to_hf_model(model).to(torch.bfloat16 if dtype == "bf16" else torch.float32).eval()
    low = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")
    gen_cfg = hf.generation_config
    gen_cfg.pad_token_id, gen_cfg.eos_token_id, gen_cfg.bos_token_id = 0, None, None
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(16, 65, (B,), generator=g).tolist()
    prompts = [torch.randint(1, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    L = max(lens)
    ids, am = torch.zeros(B, L, dtype=torch.long), torch.zeros(B, L, dtype=torch.long)
    for i, p in enumerate(prompts): ids[i, L - len(p):], am[i, L - len(p):] = torch.tensor(p), 1
    def ours():
        with low: return generate(model, None, prompts, max_new_tokens=n_new, stop_ids=[])
    def theirs():
        with torch.inference_mode():
            return hf.generate(input_ids=ids, attention_mask=am, max_new_tokens=n_new, min_new_tokens=n_new,
                               do_sample=False)[:, L:].tolist()
    a, b = ours(), theirs()
    agree = sum(x == y for r, s in zip(a, b) for x, y in zip(r, s)) / (B * n_new)
    now = time.process_time if clock == "cpu" else time.perf_counter
    t = {"tendril": [], "hf": []}
    for r in range(rounds):
        for name, f in (("tendril", ours), ("hf", theirs)) if r % 2 == 0 else (("hf", theirs), ("tendril", ours)):
            c = now(); f(); t[name].append(now() - c)
    print(json.dumps(dict(root=root, agree=agree, **t)))

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("roots", nargs="*",
                   help="checkouts to compare (folders holding gradient_garden/; --smoke: this one)")
    p.add_argument("--reps", type=int, default=2, help="worker processes per checkout, alternating with the others")
    p.add_argument("--rounds", type=int, default=4, help="timed batches per contender in each worker")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    # common.add_smoke's flag, spelled out: importing bench/common.py would import this checkout's package before
    # a worker's
    p.add_argument("--smoke", action="store_true",
                   help="this checkout only, one worker, one round of 2 rows x 4 tokens (seconds)")
    args = p.parse_args(argv)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if args.smoke: args.roots, args.reps, args.rounds = args.roots or [here], 1, 1
    if not args.roots: p.error("give one or more checkouts")
    if args.worker: return worker(args.roots[0], args.rounds, args.threads, args.clock, args.dtype, args.smoke)
    roots = [os.path.abspath(r) for r in args.roots]
    res = {r: {"tendril": [], "hf": [], "agree": None} for r in roots}
    for k in range(args.reps):
        for r in roots if k % 2 == 0 else roots[::-1]:
            cmd = [sys.executable, __file__, r, "--worker", "--rounds", str(args.rounds),
                   "--threads", str(args.threads), "--clock", args.clock, "--dtype", args.dtype]
            cmd += ["--smoke"] * args.smoke
            out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": r})
            if out.returncode: raise SystemExit(f"worker for {r} failed:\n{out.stderr[-2000:]}")
            d = json.loads(out.stdout.strip().splitlines()[-1])
            res[r]["tendril"] += d["tendril"]; res[r]["hf"] += d["hf"]; res[r]["agree"] = d["agree"]
    load = os.getloadavg()
    summary = {}
    for r, d in res.items():
        mt, mh = statistics.median(d["tendril"]), statistics.median(d["hf"])
        summary[r] = dict(tendril_ms=round(mt * 1e3, 1), hf_ms=round(mh * 1e3, 1), ratio=round(mh / mt, 3),
                          agree=d["agree"], n=len(d["tendril"]))
        print(f"{r}: tendril {mt*1e3:.1f} ms, hf {mh*1e3:.1f} ms, {mh/mt:.2f}x ({args.clock} time, "
              f"{len(d['tendril'])} batches each)")
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; {args.threads} torch thread(s); {args.dtype}")
    print(json.dumps(dict(bench="generate_versions", smoke=args.smoke, clock=args.clock, dtype=args.dtype,
                          threads=args.threads, load=load, results=summary)))

if __name__ == "__main__":
    main()
