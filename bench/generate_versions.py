"""Tendril `generate` against transformers' `generate` on several checkouts of this code, side by side in one run.

Each checkout (a folder holding `gradient_garden/`, e.g. one made by `git worktree add /tmp/old <commit>`) is timed
in fresh worker processes that alternate with the other checkouts' workers, so machine load falls on all of them
alike; with `--inline`, one worker process imports every checkout (the others under names of their own) and calls
their `generate` alternately, call after call, which is the fairest comparison on a busy machine. A worker builds the
`bench/generate.py` model (seed 0, dim 256, 4 layers, vocab 8192) in each checkout, its transformers twin, and
`--batch-size` left-padded prompts of 16-64 tokens, then times the decoders alternately for `--rounds` batches of
64 greedy tokens. Reported per checkout: medians (CPU time by default: wall time is meaningless on a loaded
machine), the ratio to transformers and to the first checkout, the share of greedy tokens that agree with
transformers, and whether the tokens equal the first checkout's.

    python bench/generate_versions.py . /tmp/old --reps 2 --rounds 4 --threads 1 [--dtype bf16]
    python bench/generate_versions.py . /tmp/old --inline --reps 1 --rounds 7 --batch-size 1
    python bench/generate_versions.py --smoke        # this checkout alone, one worker, one round of 2 rows x 4 tokens

`--dtype bf16` decodes as `bench/generate.py --dtype bf16` does: our fp32 model under `torch.autocast(bf16)`, the
transformers twin in bf16 weights.

The last line of stdout is one JSON object with the figures.
"""
from __future__ import annotations
import argparse, importlib, importlib.util, json, os, statistics, subprocess, sys, time

def load_checkout(root: str, alias: str):
    "The package of the checkout at `root`, imported as `alias` (`gradient_garden` for the first, first on sys.path)."
    if alias == "gradient_garden":
        sys.path.insert(0, root)
        return importlib.import_module(alias)
    pkg = os.path.join(root, "gradient_garden")
    spec = importlib.util.spec_from_file_location(alias, os.path.join(pkg, "__init__.py"),
                                                  submodule_search_locations=[pkg])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[alias] = mod
    spec.loader.exec_module(mod)
    return mod

def generate_of(alias: str):
    "A checkout's `generate`: in `batching` since it runs on the decoder, in `generation` before."
    for name in ("batching", "generation"):
        try: fn = getattr(importlib.import_module(f"{alias}.{name}"), "generate", None)
        except ImportError: fn = None
        if fn is not None: return fn
    raise SystemExit(f"{alias}: no generate in batching or generation")

def worker(roots: list[str], rounds: int, threads: int, clock: str, dtype: str = "fp32", smoke: bool = False,
           batch_size: int = 8):
    "Time checkouts in one process (the first as `gradient_garden`, the others aliased); print a JSON line."
    import torch
    torch.set_num_threads(threads)
    pkgs = [load_checkout(r, "gradient_garden" if i == 0 else f"gg_checkout_{i}") for i, r in enumerate(roots)]
    for r, pkg in zip(roots, pkgs):
        assert os.path.realpath(pkg.__file__).startswith(os.path.realpath(r)), pkg.__file__
    try: to_hf_model = importlib.import_module("gradient_garden.checkpoint.hf").to_hf_model
    except ImportError: to_hf_model = importlib.import_module("gradient_garden.models.hf").to_hf_model   # older
    B, n_new = (2, 4) if smoke else (batch_size, 64)
    shape = dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=8192, multiple_of=256, max_seq_len=128,
                 tie_embeddings=False)
    if smoke: shape.update(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=64)
    models = []
    for i, pkg in enumerate(pkgs):       # each checkout's own Tendril class, the first one's weights
        mod = importlib.import_module(f"{pkg.__name__}.models.tendril")
        cfg = importlib.import_module(f"{pkg.__name__}.config").ModelConfig(**shape)
        torch.manual_seed(0)
        models.append(mod.Tendril(cfg).eval())
        if i: models[-1].load_state_dict(models[0].state_dict())
    hf = to_hf_model(models[0]).to(torch.bfloat16 if dtype == "bf16" else torch.float32).eval()
    low = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")
    gen_cfg = hf.generation_config
    gen_cfg.pad_token_id, gen_cfg.eos_token_id, gen_cfg.bos_token_id = 0, None, None
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(16, 65, (B,), generator=g).tolist()
    prompts = [torch.randint(1, shape["vocab_size"], (n,), generator=g).tolist() for n in lens]
    L = max(lens)
    ids, am = torch.zeros(B, L, dtype=torch.long), torch.zeros(B, L, dtype=torch.long)
    for i, p in enumerate(prompts): ids[i, L - len(p):], am[i, L - len(p):] = torch.tensor(p), 1
    def ours(k):
        generate, model = generate_of(pkgs[k].__name__), models[k]
        def run():
            with low: return generate(model, None, prompts, max_new_tokens=n_new, stop_ids=[])
        return run
    def theirs():
        with torch.inference_mode():
            return hf.generate(input_ids=ids, attention_mask=am, max_new_tokens=n_new, min_new_tokens=n_new,
                               do_sample=False)[:, L:].tolist()
    runs = {f"tendril{k}": ours(k) for k in range(len(pkgs))} | {"hf": theirs}
    outs = {n: f() for n, f in runs.items()}
    agree = [sum(x == y for r, s in zip(outs[f"tendril{k}"], outs["hf"]) for x, y in zip(r, s)) / (B * n_new)
             for k in range(len(pkgs))]
    now = time.process_time if clock == "cpu" else time.perf_counter
    t, names = {n: [] for n in runs}, list(runs)
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:      # rotated: each goes first in turn
            c = now(); runs[n](); t[n].append(now() - c)
    print(json.dumps(dict(roots=roots, agree=agree, equal_to_first=[outs[f"tendril{k}"] == outs["tendril0"]
                                                                     for k in range(len(pkgs))],
                          tendril=[t[f"tendril{k}"] for k in range(len(pkgs))], hf=t["hf"])))

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("roots", nargs="*",
                   help="checkouts to compare (folders holding gradient_garden/; --smoke: this one)")
    p.add_argument("--reps", type=int, default=2, help="worker processes per checkout, alternating with the others")
    p.add_argument("--rounds", type=int, default=4, help="timed batches per contender in each worker")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")
    p.add_argument("--inline", action="store_true",
                   help="every checkout in each worker process, their calls alternating (else one process each)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    # common.add_smoke's flag, spelled out: importing bench/common.py would import this checkout's package before
    # a worker's
    p.add_argument("--smoke", action="store_true",
                   help="this checkout only, one worker, one round of 2 rows x 4 tokens (seconds)")
    args = p.parse_args(argv)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if args.smoke: args.roots, args.reps, args.rounds = args.roots or [here], 1, 1
    if not args.roots: p.error("give one or more checkouts")
    if args.worker: return worker(args.roots, args.rounds, args.threads, args.clock, args.dtype, args.smoke,
                                  args.batch_size)
    roots = [os.path.abspath(r) for r in args.roots]
    res = {r: {"tendril": [], "hf": [], "agree": None, "equal_to_first": None} for r in roots}
    flags = ["--worker", "--rounds", str(args.rounds), "--threads", str(args.threads), "--clock", args.clock,
             "--dtype", args.dtype, "--batch-size", str(args.batch_size)] + ["--smoke"] * args.smoke
    for k in range(args.reps):
        # --inline: one process holds every checkout (the first on PYTHONPATH); else one process per checkout
        groups = [roots if k % 2 == 0 else roots[1:] + roots[:1]] if args.inline else [[r] for r in roots]
        for group in groups if k % 2 == 0 else groups[::-1]:
            out = subprocess.run([sys.executable, __file__, *group, *flags], capture_output=True, text=True,
                                 env={**os.environ, "PYTHONPATH": group[0]})
            if out.returncode: raise SystemExit(f"worker for {group} failed:\n{out.stderr[-2000:]}")
            d = json.loads(out.stdout.strip().splitlines()[-1])
            for j, r in enumerate(d["roots"]):
                res[r]["tendril"] += d["tendril"][j]; res[r]["hf"] += d["hf"]; res[r]["agree"] = d["agree"][j]
                if args.inline:
                    first = d["equal_to_first"][d["roots"].index(roots[0])] if roots[0] in d["roots"] else None
                    res[r]["equal_to_first"] = d["equal_to_first"][j] and first
    load = os.getloadavg()
    summary = {}
    first = statistics.median(res[roots[0]]["tendril"])
    for r, d in res.items():
        mt, mh = statistics.median(d["tendril"]), statistics.median(d["hf"])
        summary[r] = dict(tendril_ms=round(mt * 1e3, 2), hf_ms=round(mh * 1e3, 2), ratio=round(mh / mt, 3),
                          time_over_first=round(mt / first, 3), agree=d["agree"], equal_to_first=d["equal_to_first"],
                          n=len(d["tendril"]))
        print(f"{r}: tendril {mt*1e3:.1f} ms, hf {mh*1e3:.1f} ms, {mh/mt:.2f}x hf, {mt/first:.3f}x the first's time "
              f"({args.clock} time, {len(d['tendril'])} batches each)")
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; {args.threads} torch thread(s); {args.dtype}; "
          f"batch {args.batch_size}{'; inline' if args.inline else ''}")
    print(json.dumps(dict(bench="generate_versions", smoke=args.smoke, clock=args.clock, dtype=args.dtype,
                          threads=args.threads, batch_size=args.batch_size, inline=args.inline, load=load,
                          results=summary)))

if __name__ == "__main__":
    main()
