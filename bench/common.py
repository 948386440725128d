"""Pieces every benchmark script shares: the common command-line flags, device synchronisation, and the measured
matmul peak that MFU is quoted against."""
from __future__ import annotations
import argparse
import torch
from gradient_garden.hardware import measure_matmul_peak


def bench_parser(doc: str, rounds: int = 8, steps_per_round: int = 2, warmup: int = 2, batch_size: int = 8,
                 seq_len: int = 256) -> argparse.ArgumentParser:
    "A parser with the flags of the side-by-side training benchmarks (device, dtype, shape, rounds)."
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16"], help="default: fp32 on CPU, bf16 autocast on CUDA")
    p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--seq-len", type=int, default=seq_len)
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--steps-per-round", type=int, default=steps_per_round)
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    return p


def setup(args) -> tuple[str, str, torch.dtype | None]:
    "Apply `--threads`; return (device type, dtype name, autocast dtype or None) for the run."
    if args.threads: torch.set_num_threads(args.threads)
    dev_type = torch.device(args.device).type
    dtype = args.dtype or ("bf16" if dev_type == "cuda" else "fp32")
    return dev_type, dtype, torch.bfloat16 if dtype == "bf16" else None


def sync(device: str):
    "Wait for queued GPU work, so wall-clock timings cover it."
    if device.startswith("cuda"): torch.cuda.synchronize()


def matmul_peak_flops(device: str, dtype) -> float:
    "Best FLOP/s of a large square matmul on this device (the measured peak MFU is quoted against)."
    cpu = device == "cpu"
    return measure_matmul_peak(torch.device(device), n=2048 if cpu else 8192, reps=8 if cpu else 20, dtype=dtype, refresh=True)
