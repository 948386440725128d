"""Data preparation throughput and memory: streaming `prepare_pretraining` vs a naive in-memory reference.

Figures:
- embedded default: `gg prepare --recipe recipes/pretraining/debug.yaml` end to end in a fresh folder (imports,
  BPE training, tokenization, shards), once — the target is under 60 s on 2 cores.
- stream vs naive on a local jsonl corpus of `--base-mb` MB (stdlib files, one document each) and on one `--scale`
  times larger (copies of it, each document marked so its hash differs): tokens/s, MB/s of input text, peak RSS.
  The naive reference is the usual one-shot script: read every document, `encode_batch` them all, concatenate, write.
  Every run is a fresh child process (peak RSS = its ru_maxrss); contenders alternate each repeat; figures are medians.
  The target: streaming peak memory on the larger corpus stays within 1.5x of the base corpus.

    python bench/prepare.py                      # 4 MB and 40 MB corpora, 3 repeats
    python bench/prepare.py --base-mb 2 --repeats 1
    python bench/prepare.py --smoke              # 0.05 MB corpora (x2), one repeat, a 1k BPE; the embedded default
                                                 # prepared to 50k tokens; everything in a temporary folder

The last line of stdout is one JSON object with the figures.
"""
from __future__ import annotations
import argparse, json, os, resource, shutil, statistics, subprocess, sys, tempfile, time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_smoke, apply_smoke


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-mb", type=float, default=4.0, help="size of the base corpus in MB of text")
    p.add_argument("--scale", type=int, default=10, help="the larger corpus is this many copies of the base")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokenizer", default=str(REPO / "data" / "tokenizers" / "garden-bpe-4k"),
                   help="tokenizer folder (trained on the embedded corpus if missing)")
    p.add_argument("--no-naive", action="store_true", help="skip the naive reference")
    p.add_argument("--no-embedded", action="store_true", help="skip the end-to-end embedded default run")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = apply_smoke(add_smoke(p).parse_args(argv), base_mb=0.05, scale=2, repeats=1)
    # a small one, trained in the work folder
    if args.smoke and args.tokenizer == p.get_default("tokenizer"): args.tokenizer = None
    return args


def rss_mb() -> float:
    "Current resident set size of this process, in MB."
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"): return int(line.split()[1]) / 1024
    return float("nan")


def peak_mb() -> float: return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---------------------------------------------------------------- children (one measurement each)

def naive_prepare(files, tok, out_dir, val_fraction):
    "The one-shot reference: all documents in memory, one encode_batch, one concatenate, one write per split."
    import numpy as np
    from gradient_garden.data.prepare import is_validation
    docs = [json.loads(line)["text"] for f in files for line in open(f)]
    ids = tok.encode_batch(docs)
    split = [is_validation(d.encode("utf-8", "surrogatepass"), val_fraction) for d in docs]
    out_dir.mkdir(parents=True, exist_ok=True)
    n = 0
    for name, want in (("train", False), ("val", True)):
        arr = np.concatenate([np.array(x + [tok.eos_id], dtype=np.uint16) for x, s in zip(ids, split) if s == want]
                             or [np.zeros(0, np.uint16)])   # a corpus of a few documents may have none for validation
        arr.tofile(out_dir / f"{name}.bin")
        n += len(arr)
    return {"tokens": n, "bytes": sum(len(d.encode()) for d in docs)}


def child(spec: dict) -> dict:
    "Run one measurement in this (fresh) process."
    if spec["kind"] == "embedded":
        t0 = time.perf_counter()
        from gradient_garden.cli.prepare import add_prepare_args, run_prepare
        os.chdir(spec["cwd"])
        sets = ["--set", *spec["overrides"]] if spec.get("overrides") else []
        argv = ["--recipe", spec["recipe"], "--no-progress", *sets]
        args = add_prepare_args(argparse.ArgumentParser()).parse_args(argv)
        run_prepare(args)
        meta = json.loads(Path("data/datasets/pretraining/meta.json").read_text())
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "prepare_s": meta["elapsed_s"], "tokens": meta["n_tokens"],
                "bytes": sum(s["bytes"] for s in meta["sources"].values()), "peak_rss_mb": peak_mb()}
    from gradient_garden.config import TokenizerConfig
    from gradient_garden.tokenizer import init_tokenizer
    from gradient_garden.data.prepare import parse_pretraining_data, prepare_pretraining
    tok = init_tokenizer(TokenizerConfig(path=spec["tokenizer"]))
    tok.encode_batch(["warm up"])
    base_rss, out = rss_mb(), Path(spec["out"])
    t0 = time.perf_counter()
    if spec["kind"] == "stream":
        data = {"target_tokens": 10**12, "val_fraction": 0.01, "shard_tokens": 1 << 24,
                "mix": [{"type": "local", "files": spec["files"], "format": "json"}]}
        meta = prepare_pretraining(parse_pretraining_data(data), tok, out, progress=False)
        got = {"tokens": meta["n_tokens"], "bytes": sum(s["bytes"] for s in meta["sources"].values())}
    else:
        got = naive_prepare(spec["files"], tok, out, 0.01)
    wall = time.perf_counter() - t0
    return {**got, "wall_s": wall, "baseline_rss_mb": base_rss, "peak_rss_mb": peak_mb()}


def run_child(spec: dict) -> dict:
    "Measure `spec` in a fresh Python process; return its figures."
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True)
    if r.returncode: raise SystemExit(f"child {spec['kind']} failed:\n{r.stderr[-3000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    res["process_wall_s"] = time.perf_counter() - t0
    return res


# ---------------------------------------------------------------- setup

def build_corpora(root: Path, base_mb: float, scale: int) -> tuple[list[str], list[str]]:
    "A base jsonl corpus of stdlib files (one document each) and `scale` marked copies of it."
    from gradient_garden.data.prepare import stdlib_files
    docs, size = [], 0
    for f in stdlib_files():
        text = Path(f).read_text(errors="replace")
        docs.append(text); size += len(text.encode())
        if size >= base_mb * 1e6: break
    base = root / "base.jsonl"
    base.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    large = []
    for k in range(scale):
        p = root / f"large_{k:02d}.jsonl"
        p.write_text("".join(json.dumps({"text": f"# copy {k}\n{d}"}) + "\n" for d in docs))
        large.append(str(p))
    return [str(base)], large


def ensure_bench_tokenizer(path: str) -> None:
    "Train the embedded 4k BPE at `path` if it is missing (as `gg prepare` would)."
    from gradient_garden.config import TokenizerConfig
    from gradient_garden.tokenizer import ensure_tokenizer
    from gradient_garden.data.prepare import DEFAULT_PRETRAINING_DATA, parse_pretraining_data, tokenizer_texts
    spec = parse_pretraining_data(DEFAULT_PRETRAINING_DATA)
    ensure_tokenizer(TokenizerConfig(path=path), lambda: tokenizer_texts(spec), vocab_size=4096)


def summary(runs: list[dict]) -> dict:
    "Medians of the figures over repeats."
    med = lambda k: statistics.median(r[k] for r in runs)
    wall = med("wall_s")
    return {"tokens": runs[0]["tokens"], "mb": round(runs[0]["bytes"] / 1e6, 2), "wall_s": round(wall, 2),
            "tokens_per_s": round(runs[0]["tokens"] / wall), "mb_per_s": round(runs[0]["bytes"] / 1e6 / wall, 2),
            "peak_rss_mb": round(med("peak_rss_mb"), 1), "baseline_rss_mb": round(med("baseline_rss_mb"), 1),
            "repeats": len(runs)}


def main(args) -> dict:
    root = Path(tempfile.mkdtemp(prefix="gg-bench-prepare-"))
    if args.tokenizer is None:   # smoke: a 1k BPE on a few standard-library files, in seconds
        from gradient_garden.data.prepare import stdlib_files
        from gradient_garden.tokenizer import train_bpe
        texts = [Path(f).read_text(errors="replace") for f in stdlib_files()[:40]]
        args.tokenizer = str(train_bpe(texts, 1024, root/"tok"))
    else: ensure_bench_tokenizer(args.tokenizer)
    try:
        base, large = build_corpora(root, args.base_mb, args.scale)
        contenders = ["stream"] + ([] if args.no_naive else ["naive"])
        results = {}
        for rep in range(args.repeats):
            order = contenders if rep % 2 == 0 else contenders[::-1]
            for size, files in (("1x", base), (f"{args.scale}x", large)):
                for kind in order:
                    out = root / f"out-{kind}-{size}"
                    shutil.rmtree(out, ignore_errors=True)
                    r = run_child({"kind": kind, "files": files, "tokenizer": args.tokenizer, "out": str(out)})
                    results.setdefault(f"{kind}_{size}", []).append(r)
                    print(f"repeat {rep}: {kind:6s} {size:>4s} {r['tokens']:>11,} tokens in {r['wall_s']:6.2f}s "
                          f"({r['tokens'] / r['wall_s']:>9,.0f} tok/s), peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)
                    shutil.rmtree(out, ignore_errors=True)
        figures = {k: summary(v) for k, v in results.items()}
        big = f"{args.scale}x"
        peak = lambda kind: figures[kind]["peak_rss_mb"]
        figures["stream_peak_ratio"] = round(peak(f"stream_{big}") / peak("stream_1x"), 3)
        if not args.no_naive:
            figures["naive_peak_ratio"] = round(peak(f"naive_{big}") / peak("naive_1x"), 3)
        if not args.no_embedded:
            cwd = root / "embedded"; cwd.mkdir()
            r = run_child({"kind": "embedded", "cwd": str(cwd),
                           "recipe": str(REPO / "recipes" / "pretraining" / "debug.yaml"),
                           "overrides": ["data.target_tokens=50000"] if args.smoke else []})
            figures["embedded_default"] = {"wall_s": round(r["process_wall_s"], 2),
                                           "prepare_s": round(r["prepare_s"], 2),
                                           "tokens": r["tokens"], "tokens_per_s": round(r["tokens"] / r["prepare_s"]),
                                           "mb_per_s": round(r["bytes"] / 1e6 / r["prepare_s"], 2),
                                           "peak_rss_mb": round(r["peak_rss_mb"], 1)}
            print(f"embedded default end to end (BPE training included): {r['process_wall_s']:.1f}s, "
                  f"{r['tokens']:,} tokens, peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)
        figures["targets"] = {"stream_peak_ratio_max": 1.5, "stream_peak_ratio_ok": figures["stream_peak_ratio"] <= 1.5,
                              **({"embedded_default_max_s": 60,
                                  "embedded_default_ok": figures["embedded_default"]["wall_s"] < 60}
                                 if not args.no_embedded else {})}
        figures["cpus"], figures["smoke"] = os.cpu_count(), args.smoke
        return figures
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    args = parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
    else:
        print(json.dumps(main(args)))
