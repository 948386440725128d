"""Pieces every benchmark script shares: the common command-line flags, device synchronisation, and the measured
matmul peak that MFU is quoted against."""
from __future__ import annotations
import argparse
from pathlib import Path
import torch
from gradient_garden.hardware import measure_matmul_peak


def bench_parser(doc: str, rounds: int = 8, steps_per_round: int = 2, warmup: int = 2, batch_size: int = 8,
                 seq_len: int = 256) -> argparse.ArgumentParser:
    "A parser with the flags of the side-by-side training benchmarks (device, dtype, shape, rounds)."
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16"],
                   help="default: fp32 on CPU, bf16 autocast on CUDA")
    p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--seq-len", type=int, default=seq_len)
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--steps-per-round", type=int, default=steps_per_round)
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    return add_smoke(p)


def setup(args) -> tuple[str, str, torch.dtype | None]:
    "Apply `--threads`; return (device type, dtype name, autocast dtype or None) for the run."
    if args.threads: torch.set_num_threads(args.threads)
    dev_type = torch.device(args.device).type
    dtype = args.dtype or ("bf16" if dev_type == "cuda" else "fp32")
    return dev_type, dtype, torch.bfloat16 if dtype == "bf16" else None


def sync(device: str):
    "Wait for queued GPU work, so wall-clock timings cover it."
    if device.startswith("cuda"): torch.cuda.synchronize()


def matmul_peak_flops(device: str, dtype, smoke: bool = False) -> float:
    "Best FLOP/s of a large square matmul on this device (the peak MFU is quoted against; 256^2 in smoke mode)."
    cpu = device == "cpu"
    n, reps = (256, 2) if smoke else (2048 if cpu else 8192, 8 if cpu else 20)
    return measure_matmul_peak(torch.device(device), n=n, reps=reps, dtype=dtype, refresh=True)


# ---------------------------------------------------------------- smoke mode
# Every script in bench/ takes `--smoke`: tiny shapes, one or two repeats, done in seconds, through the same code as
# the real run, still ending in its one JSON line; results files go to a temporary folder. tests/test_bench_smoke.py
# runs each one that way, so that no script rots between the times someone measures with it.

SMOKE_HELP = "tiny shapes and one or two repeats, in seconds (what CI runs); results files go to a temporary folder"


def add_smoke(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    "Give parser `p` the `--smoke` flag."
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    return p


def apply_smoke(args, **tiny):
    "In smoke mode (`args.smoke`), set every attribute named in `tiny` on `args`; return `args`."
    if getattr(args, "smoke", False):
        for k, v in tiny.items(): setattr(args, k, v)
    return args


def smoke_requested(argv=None) -> bool:
    "Whether `--smoke` is on the command line (for scripts that read `sys.argv` themselves)."
    import sys
    return "--smoke" in (sys.argv[1:] if argv is None else argv)


def smoke_dir(name: str = "bench") -> Path:
    "A fresh temporary folder for a smoke run's files (nothing of a smoke run is written into the repository)."
    import tempfile
    return Path(tempfile.mkdtemp(prefix=f"gg_smoke_{name}_"))


def results_path(default, smoke: bool):
    "Where a results file goes: `default`, or the same name in a temporary folder in smoke mode."
    return smoke_dir("results")/Path(default).name if smoke else Path(default)


def reference_available(module: str, leg: str) -> bool:
    "Whether the reference library `module` can be imported; when not, say on stderr that `leg` is skipped."
    import importlib.util, sys
    try:
        if importlib.util.find_spec(module) is not None: return True
    except (ImportError, ValueError): pass
    print(f"skipped {leg}: {module} is not installed", file=sys.stderr)
    return False


def smoke_exit(bench: str, reason: str, **extra):
    "End a smoke run that cannot run here: one line saying why, then the JSON line; exit status 0."
    import json, sys
    print(f"{bench}: {reason}")
    print(json.dumps(dict(bench=bench, smoke=True, skipped=reason, **extra)))
    sys.exit(0)


def synthetic_pretraining_data(root, vocab: int, n_tokens: int) -> dict:
    """A small BPE and random-token train/val shards in `gg prepare`'s layout, under `root`: `gg train` and the
    loaders read them as they read real ones. Returns the `tokenizer` and `datasets` folders."""
    import json
    import numpy as np
    from gradient_garden.config import TokenizerConfig
    from gradient_garden.data.prepare import SHARD_FORMAT, SHARD_VERSION
    from gradient_garden.tokenizer import init_tokenizer, train_bpe
    root, repo = Path(root), Path(__file__).resolve().parent.parent
    sources = [p.read_text() for p in sorted((repo/"gradient_garden").rglob("*.py"))]
    text = [(repo/"README.md").read_text()] * 4 + sources
    train_bpe(text, vocab, root/"tokenizer")
    tok = init_tokenizer(TokenizerConfig(path=str(root/"tokenizer")))
    rng, d, splits = np.random.default_rng(0), root/"datasets"/"pretraining", {}
    for split, n in (("train", n_tokens), ("val", n_tokens // 8)):
        (d/split).mkdir(parents=True, exist_ok=True)
        rng.integers(0, tok.vocab_size, n, dtype=np.uint16).tofile(d/split/"shard_00000.bin")
        splits[split] = {"n_tokens": n, "documents": 1, "shards": [{"file": f"{split}/shard_00000.bin", "n_tokens": n}]}
    meta = {"format": SHARD_FORMAT, "version": SHARD_VERSION, "stage": "pretraining", "dtype": "uint16",
            "tokenizer": {"identity": tok.identity, "name": "synthetic"}, "documents_begin_with_bos": False,
            "splits": splits}
    (d/"meta.json").write_text(json.dumps(meta))
    return dict(tokenizer=root/"tokenizer", datasets=root/"datasets")
