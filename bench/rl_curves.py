"""The curves of an RL run, read from its `metrics.jsonl`: per logged step the reward mean and std, the share of
zero-variance groups, the sampling rounds, entropy, clip fraction and KL; per validation the held-out exact match,
overall and per task. What to read when a run does not learn: whether the batch had any signal (zero-variance share,
rounds), whether the policy moved (entropy, clip fraction, KL), and which tasks moved (per-task exact match).

Usage: python bench/rl_curves.py runs/rl/debug [--every 5]
       python bench/rl_curves.py --smoke         # a few made-up records of the rl stage's keys, in a temporary folder

The last line of stdout is one JSON object: the records read and the keys found.
"""
from __future__ import annotations
import argparse, json
from pathlib import Path
from common import add_smoke, smoke_dir

TRAIN = ("reward_mean", "reward_std", "zero_std_groups", "sampling_rounds", "completion_len", "entropy",
         "clip_fraction", "kl")


def read(run: Path) -> list[dict]:
    f = run/"metrics.jsonl"
    if not f.is_file(): raise SystemExit(f"error: {f} not found; give an RL run directory such as runs/rl/debug")
    return [json.loads(l) for l in f.read_text().splitlines() if l.strip()]


def table(rows: list[dict], keys: list[str]) -> str:
    "A plain fixed-width table of `keys` (absent values blank)."
    cell = lambda v: "" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)
    w = [max(len(k), *(len(cell(r.get(k))) for r in rows)) for k in keys]
    lines = ["  ".join(k.rjust(n) for k, n in zip(keys, w))]
    return "\n".join(lines + ["  ".join(cell(r.get(k)).rjust(n) for k, n in zip(keys, w)) for r in rows])


def smoke_run() -> Path:
    "A run folder whose metrics.jsonl holds three training records and a validation, as the rl stage logs them."
    run = smoke_dir("rl_curves")
    rows = [{"step": s, "loss": 0.1, **{k: 0.5 for k in TRAIN}} for s in (1, 2, 3)]
    rows.append({"step": 3, "val_exact_match": 0.25, "val_exact_match/copy": 0.5, "val_exact_match/add": 0.0})
    (run/"metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path, nargs="?")
    p.add_argument("--every", type=int, default=1, help="show every n-th training record")
    a = add_smoke(p).parse_args()
    if a.smoke and a.run is None: a.run = smoke_run()
    if a.run is None: p.error("give an RL run directory such as runs/rl/debug")
    recs = read(a.run)
    train = [r for r in recs if "loss" in r and "reward_mean" in r][::max(a.every, 1)]
    keys = ["step"] + [k for k in TRAIN if any(k in r for r in train)]
    print(table(train, keys))
    val = [r for r in recs if "val_exact_match" in r]
    if val:
        tasks = sorted({k for r in val for k in r if k.startswith("val_exact_match/")})
        print()
        rows = [{"step": r["step"], **{k.removeprefix("val_"): r.get(k) for k in ["val_exact_match", *tasks]}}
                for r in val]
        print(table(rows, ["step", "exact_match"] + [t.removeprefix("val_") for t in tasks]))
    print(json.dumps(dict(bench="rl_curves", smoke=a.smoke, run=str(a.run), train_records=len(train),
                          validations=len(val), train_keys=keys[1:],
                          last_val_exact_match=val[-1]["val_exact_match"] if val else None)))


if __name__ == "__main__":
    main()
