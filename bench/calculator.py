"""Greedy exact match on the calculator task (nbs/36_environments.ipynb) of checkpoints, with the tool and without it.

Usage: python bench/calculator.py SPLIT N NAME=CHECKPOINT [NAME=CHECKPOINT ...]
  SPLIT: dev (for tuning) or test (for figures); N problems, add and subtract in turn.
"Without" runs `CalculatorEnv(max_calls=0)`: the first turn is the final answer, so a tool call there scores 0.
"""
import json, sys, time
import torch
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


def main(split: str, n: int, named: list[str], tokenizer: str = "data/tokenizers/garden-bpe-4k"):
    tok = init_tokenizer(TokenizerConfig(backend="huggingface", path=tokenizer))
    probs = calc_problems(n, split)
    for name, path in (a.split("=", 1) for a in named):
        m, t0 = load(path), time.perf_counter()
        with torch.no_grad():
            row = {"with_tool": environment_exact_match(m, tok, probs, "calculator", 24, 3),
                   "without_tool": environment_exact_match(m, tok, probs, lambda: CalculatorEnv(max_calls=0), 24, 1)}
        figs = {k: {f: round(x, 4) for f, x in v.items() if not f.startswith("n")} for k, v in row.items()}
        print(json.dumps({"name": name, "split": split, "n": n, **figs,
                          "seconds": round(time.perf_counter() - t0, 1)}), flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 4: sys.exit(__doc__)
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
