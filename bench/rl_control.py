"""The control of a reference-guided RL recipe: the same run with the sampled rows' loss zeroed.

`python bench/rl_control.py --recipe recipes/rl/debug-reference-guided.yaml --checkpoint runs/instruct/debug [gg train
flags]` runs `gg train` with the stage's clipped policy-gradient term multiplied by zero before the reference rows'
loss replaces it on their rows. What is left is the reference rows' supervised term over the same denominator, so the
guided run minus this control is what the on-policy rows add. The run is named `<recipe's run.name>-control`.

`python bench/rl_control.py --smoke` checks the control on one micro-batch of a random dim-64 model (G 4, 2 of them
reference rows): its loss equals the stage's own loss with the sampled rows' advantages set to zero.
"""
import json, sys
from pathlib import Path
from types import SimpleNamespace

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


def smoke() -> dict:
    "The control's loss on one guided micro-batch, and the stage's loss on it with the sampled rows' advantages zeroed."
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import smoke_dir
    from rl import setup, smoke_checkpoint
    from gradient_garden.config import RLConfig
    from gradient_garden.evals.verifiers import from_verifiable
    from gradient_garden.stages.rewards import Rewarder
    from gradient_garden.stages.rl_rollouts import RolloutLoader
    ck = smoke_checkpoint(smoke_dir("rl_control"))
    _, model, tok, exs = setup(SimpleNamespace(checkpoint=ck, prompts=2, steps=1))
    rl = RLConfig(group_size=4, off_policy_rows=2, off_policy_loss="log_likelihood", off_policy_weight=10.0,
                  max_new_tokens=4)
    batch = RolloutLoader(model, tok, [from_verifiable(e) for e in exs], rl, Rewarder(), 64, 8, 1, seed=0).next_batch()
    off = batch["off_policy"].bool()
    batch["advantages"] = torch.where(off, batch["advantages"], torch.linspace(-1.0, 1.0, len(off)))  # rows that teach
    task = rl_stage.RLTask(rl, tok)
    unpatched = task.loss(model, batch)[0].item()
    rl_stage.token_losses = sampled_rows_zeroed
    try: control = task.loss(model, batch)[0].item()
    finally: rl_stage.token_losses = _token_losses
    zeroed = dict(batch, advantages=torch.where(off, batch["advantages"], 0.0))
    reference = task.loss(model, zeroed)[0].item()
    assert abs(control - reference) <= 1e-6 * max(1.0, abs(reference)), (control, reference)
    assert abs(unpatched - reference) > 1e-6, "the sampled rows carried no loss: the check would prove nothing"
    return dict(bench="rl_control", smoke=True, control_loss=control, zeroed_advantages_loss=reference,
                with_sampled_rows_loss=unpatched,
                reference_rows=int(batch["off_policy"].sum()), rows=len(batch["off_policy"]))


if __name__ == "__main__":
    torch.manual_seed(0)
    if "--smoke" in sys.argv[1:]: print(json.dumps(smoke())); sys.exit(0)
    rl_stage.token_losses = sampled_rows_zeroed
    sys.exit(main(control_argv(sys.argv[1:])))
