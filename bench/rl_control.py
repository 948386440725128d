"""The control of a reference-guided RL recipe: the same run with the sampled rows' loss zeroed.

`python bench/rl_control.py --recipe recipes/rl/debug-reference-guided.yaml --checkpoint runs/instruct/debug [gg train
flags]` runs `gg train` with the stage's clipped policy-gradient term multiplied by zero before the reference rows'
loss replaces it on their rows. What is left is the reference rows' supervised term over the same denominator, so the
guided run minus this control is what the on-policy rows add. The run is named `<recipe's run.name>-control`.
"""
import sys

import torch

import gradient_garden.stages.rl as rl_stage
from gradient_garden.cli import main

_token_losses = rl_stage.token_losses


def sampled_rows_zeroed(*args, **kwargs):
    "The stage's token losses times zero (the reference rows' own losses are put in afterwards)."
    per_token, ratio, kl = _token_losses(*args, **kwargs)
    return per_token * 0.0, ratio, kl if kl is None else kl * 0.0


def control_argv(argv: list[str]) -> list[str]:
    "`gg train` arguments of the control run: the given ones, and a run name of its own."
    from gradient_garden.recipes import load_config
    recipe = argv[argv.index("--recipe") + 1]
    cfg, _ = load_config(recipe=recipe)
    return ["train", *argv, "--set", f"run.name={cfg.run.name}-control"]


if __name__ == "__main__":
    torch.manual_seed(0)
    rl_stage.token_losses = sampled_rows_zeroed
    sys.exit(main(control_argv(sys.argv[1:])))
