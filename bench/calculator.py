"""Greedy exact match on the calculator task (nbs/36_environments.ipynb) of checkpoints, with the tool and without it.

    python bench/calculator.py SPLIT N NAME=CHECKPOINT [NAME=CHECKPOINT ...]
    python bench/calculator.py --smoke      # a random dim-64 chat model and a small BPE, 4 dev problems

SPLIT: dev (for tuning) or test (for figures); N problems, add and subtract in turn. "Without" runs
`CalculatorEnv(max_calls=0)`: the first turn is the final answer, so a tool call there scores 0. One JSON line a
checkpoint; the last line of stdout is the last checkpoint's.
"""
import argparse, json, sys, time
from pathlib import Path
import torch
from common import add_smoke, smoke_dir
from gradient_garden.checkpoint.checkpoints import load_checkpoint
from gradient_garden.config import ModelConfig, TokenizerConfig
from gradient_garden.evals.environments import CalculatorEnv, calc_problems, environment_exact_match
from gradient_garden.models.registry import build_model
from gradient_garden.tokenizer import init_tokenizer


def load(path: str):
    "The model of a full checkpoint, in eval mode."
    c = load_checkpoint(path)
    m = build_model(ModelConfig(**c["config"]["model"]))
    m.load_state_dict(c["model"])
    return m.eval()


def main(split: str, n: int, named: list[str], tokenizer: str = "data/tokenizers/garden-bpe-4k", smoke: bool = False):
    tok = init_tokenizer(TokenizerConfig(backend="huggingface", path=tokenizer))
    probs = calc_problems(n, split)
    for name, path in (a.split("=", 1) for a in named):
        m, t0 = load(path), time.perf_counter()
        with torch.no_grad():
            row = {"with_tool": environment_exact_match(m, tok, probs, "calculator", 24, 3),
                   "without_tool": environment_exact_match(m, tok, probs, lambda: CalculatorEnv(max_calls=0), 24, 1)}
        figs = {k: {f: round(x, 4) for f, x in v.items() if not f.startswith("n")} for k, v in row.items()}
        print(json.dumps({"bench": "calculator", "smoke": smoke, "name": name, "split": split, "n": n, **figs,
                          "seconds": round(time.perf_counter() - t0, 1)}), flush=True)


if __name__ == "__main__":
    p = add_smoke(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("split", nargs="?", choices=["dev", "test"])
    p.add_argument("n", nargs="?", type=int)
    p.add_argument("checkpoints", nargs="*", metavar="NAME=CHECKPOINT")
    p.add_argument("--tokenizer", default="data/tokenizers/garden-bpe-4k")
    a = p.parse_args()
    if a.smoke:   # the random chat checkpoint and BPE of bench/rl.py's smoke run
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from rl import smoke_checkpoint
        ck = smoke_checkpoint(smoke_dir("calculator"))
        a.split, a.n, a.checkpoints, a.tokenizer = "dev", 4, [f"random={ck}"], str(Path(ck).parents[1]/"tok")
    if a.split is None or a.n is None or not a.checkpoints: p.error("SPLIT, N and at least one NAME=CHECKPOINT")
    main(a.split, a.n, a.checkpoints, a.tokenizer, a.smoke)
