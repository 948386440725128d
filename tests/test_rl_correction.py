"""Rollout/trainer mismatch correction and GSPO against TRL's own code: the importance weights of all four
`vllm_importance_sampling_mode`s (TRL's lines run as they stand), the loss and gradient with the weights in and with
sequence-level ratios (TRL's `_compute_loss`); bf16 rollouts against an fp32 trainer; and the figures and bonus over
sampled rows only, with dynamic sampling's fillers out of every denominator."""
import dataclasses, inspect, math, textwrap
from types import SimpleNamespace
import pytest
import torch

from gradient_garden.config import ConfigError, RLConfig
from gradient_garden.stages.base import IGNORE_INDEX
from gradient_garden.stages.grpo import (IS_MODES, RL_LOSSES, collate_rollouts, completion_logps, group_advantages,
                                         loss_parts, mismatch_sums, sampler_weights, token_losses)
from gradient_garden.stages.rl import RLTask

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
from test_rl import LengthReward, trl_trainer  # noqa: E402  (TRL's trainer with what `_compute_loss` reads)


def trl_is_block() -> str:
    "The lines of TRL's `_generate_and_score_completions` that turn sampler and trainer log-probs into IS weights."
    src = inspect.getsource(trl_grpo.GRPOTrainer._generate_and_score_completions)
    start = src.rindex("mask = completion_mask", 0, src.index("per_token_logps_diff = (old_per_token_logps"))
    end = src.index("# Compute the per-token log probabilities for the reference model", start)
    lines = src[start:end].rstrip().splitlines()
    return textwrap.dedent("\n".join([" " * 16 + lines[0].strip()] + lines[1:]))


def trl_is_weights(old, sampler, mask, mode, clip_min, clip_max) -> torch.Tensor:
    "TRL's importance-sampling weights, computed by TRL's own lines."
    this = SimpleNamespace(vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=clip_min,
                           vllm_importance_sampling_clip_max=clip_max)
    ns = dict(self=this, torch=torch, math=math, completion_mask=mask.long(), tool_mask=None,
              old_per_token_logps=old, sampling_per_token_logps=sampler)
    exec(textwrap.dedent(trl_is_block()), ns)
    return ns["vllm_importance_sampling_ratio"]


def batch(seed=1, B=8, T=12, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(T)[None] < torch.tensor([12, 1, 5, 7, 12, 3, 9, 2])[:B, None]
    base = torch.randn(B, T, generator=g) * 0.5 - 1.5
    old = base + torch.randn(B, T, generator=g) * 0.3
    sampler = old + torch.randn(B, T, generator=g) * spread
    ref = base + torch.randn(B, T, generator=g) * 0.2
    adv = group_advantages(torch.tensor([1., 0, 1, 1, 0, 0, 1, 0]), 4)[0]
    return mask, base, old, sampler, ref, adv


def trl_loss_with(loss_type, logps, old, ref, adv, mask, beta, T, level="token", is_ratio=None):
    "TRL's `_compute_loss` (its forward replaced by `logps`), with sequence ratios and/or IS weights as asked."
    t = trl_trainer(loss_type, beta, 0.2, 0.28, T)
    t.__dict__.update(importance_sampling_level=level, use_vllm=is_ratio is not None,
                      vllm_importance_sampling_correction=is_ratio is not None,
                      _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None))
    B = logps.shape[0]
    inputs = dict(prompt_ids=torch.zeros(B, 1, dtype=torch.long), prompt_mask=torch.ones(B, 1, dtype=torch.long),
                  completion_ids=torch.zeros(B, T, dtype=torch.long), completion_mask=mask.long(), advantages=adv,
                  old_per_token_logps=old, ref_per_token_logps=ref, num_items_in_batch=mask.sum())
    if is_ratio is not None: inputs["importance_sampling_ratio"] = is_ratio
    return trl_grpo.GRPOTrainer._compute_loss(t, None, inputs)


@pytest.mark.parametrize("mode", IS_MODES)
@pytest.mark.parametrize("clip", [(None, 3.0), (0.5, 2.0), (0.8, None)])
def test_importance_weights_equal_trl(mode, clip):
    mask, _, old, sampler, _, _ = batch(spread=0.6)
    sampler[0, 3] = float("nan")                                  # a token the sampler could not score
    ours, ratio = sampler_weights(old, sampler, mask, mode, *clip)
    theirs = trl_is_weights(old, sampler, mask, mode, *clip)
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < 1e-6
    assert ((ratio < (clip[0] or 0)) | (ratio > (clip[1] or math.inf))).any()   # the cap bites somewhere


@pytest.mark.parametrize("loss_type", RL_LOSSES)
@pytest.mark.parametrize("mode", IS_MODES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_corrected_loss_and_gradient_equal_trl(loss_type, mode, beta):
    mask, base, old, sampler, ref, adv = batch()
    w = trl_is_weights(old, sampler, mask, mode, 0.5, 2.0)
    ours_lp, trl_lp = base.clone().requires_grad_(), base.clone().requires_grad_()
    s, n = loss_parts(token_losses(ours_lp, old, adv, 0.2, 0.28, beta, ref, mask, is_weight=w)[0], mask, loss_type, 12)
    ours, theirs = s / n, trl_loss_with(loss_type, trl_lp, old, ref, adv, mask, beta, 12, is_ratio=w)
    ours.backward(); theirs.backward()
    assert abs(ours.item() - theirs.item()) < 1e-6
    assert (ours_lp.grad - trl_lp.grad).abs().max().item() < 1e-6 and ours_lp.grad.abs().sum() > 0
    plain, _ = loss_parts(token_losses(base, old, adv, 0.2, 0.28, beta, ref, mask)[0], mask, loss_type, 12)
    assert abs(plain.item() - s.item()) > 1e-4                   # the weights change the loss


@pytest.mark.parametrize("loss_type", RL_LOSSES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_gspo_sequence_ratios_equal_trl(loss_type, beta):
    "rl.importance_sampling_level: sequence is TRL's importance_sampling_level='sequence' (GSPO), loss and gradient."
    mask, base, old, _, ref, adv = batch(seed=4)
    ours_lp, trl_lp = base.clone().requires_grad_(), base.clone().requires_grad_()
    per_token, ratio, _ = token_losses(ours_lp, old, adv, 0.2, 0.28, beta, ref, mask, "sequence")
    s, n = loss_parts(per_token, mask, loss_type, 12)
    theirs = trl_loss_with(loss_type, trl_lp, old, ref, adv, mask, beta, 12, level="sequence")
    (s / n).backward(); theirs.backward()
    assert abs((s / n).item() - theirs.item()) < 1e-6
    assert (ours_lp.grad - trl_lp.grad).abs().max().item() < 1e-6 and ours_lp.grad.abs().sum() > 0
    assert (ratio == ratio[:, :1]).all() and ratio[:, 0].unique().numel() == 8   # one ratio per completion
    tok, _ = loss_parts(token_losses(base, old, adv, 0.2, 0.28, beta, ref, mask)[0], mask, loss_type, 12)
    assert abs(tok.item() - s.item()) > 1e-4                     # not the token-level objective


def test_mismatch_settings_out_of_range_are_one_line():
    with pytest.raises(ConfigError, match=r"rl.importance_sampling_clip_min: got 4.0; must be in \[0, "
                                          r"rl.importance_sampling_clip_max = 3.0\]") as e:
        RLTask(RLConfig(importance_sampling_clip_min=4.0))
    assert "\n" not in str(e.value)
    mask, _, old, sampler, _, _ = batch()
    with pytest.raises(ConfigError, match="rl.importance_sampling_mode: got 'token'; allowed: token_truncate"):
        sampler_weights(old, sampler, mask, "token")
    with pytest.raises(ConfigError, match="rl.importance_sampling_level: got 'seq'"):
        token_losses(old, old, torch.zeros(8), mask=mask, level="seq")


def tiny_loader(rl: RLConfig, precision="fp32", seed=0):
    "A rollout loader over a two-layer Tendril and a made-up tokenizer; the reward is the answer's length mod 3."
    from gradient_garden.config import ModelConfig
    from gradient_garden.evals.verifiers import Problem
    from gradient_garden.models.registry import build_model
    from gradient_garden.stages.rl_rollouts import RolloutLoader
    torch.manual_seed(seed)
    model = build_model(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, max_seq_len=64))
    tok = SimpleNamespace(eot_id=2, eos_id=None, pad_id=0, encode=lambda s: [], decode=lambda ids: "x" * len(ids),
                          render_chat=lambda msgs,
                          add_generation_prompt=True: ([1] + [3 + ord(c) % 80 for c in msgs[0]["content"][:9]], None))
    exs = [Problem("verifiable", "add", f"What is {i} + {i}?", str(2 * i)) for i in range(8)]
    loader = RolloutLoader(model, tok, exs, rl, None, 32, 8, 1, seed=3, precision=precision)
    loader.rewarder = LengthReward()
    return model, loader


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_bf16_rollouts_show_the_mismatch_and_the_weights_are_trls(mode):
    ("Rollouts decoded in bf16 for an fp32 trainer: the sampler-to-trainer KL is orders above fp32 rollouts' (which "
     "agree to rounding); the batch's weights are TRL's on its two sets of log-probs; the loss takes them in.")
    rl = RLConfig(group_size=4, max_new_tokens=8, importance_sampling_correction=True, importance_sampling_mode=mode,
                  importance_sampling_clip_min=0.999, importance_sampling_clip_max=1.001)
    figs = {}
    for p in ("fp32", "bf16"):
        model, loader = tiny_loader(dataclasses.replace(rl, rollout_precision=p))
        b = loader.next_batch()
        figs[p] = b["stats"]
    assert figs["fp32"]["sampler_kl"] < 1e-10 and figs["bf16"]["sampler_kl"] > 1e-8
    assert figs["bf16"]["sampler_kl"] > 1000 * figs["fp32"]["sampler_kl"]
    assert figs["bf16"]["is_ratio_max"] > 1.0 and 0 < figs["bf16"]["is_capped"] <= 1
    m = (b["labels"] != IGNORE_INDEX) & b["keep"].bool()[:, None]
    want = trl_is_weights(b["old_logps"], b["sampler_logps"], m, mode, 0.999, 1.001)
    assert (b["is_weight"] - want).abs().max().item() < 1e-6
    with torch.no_grad():
        fresh, _ = completion_logps(model, b)
    assert (fresh - b["old_logps"])[m].abs().max().item() < 1e-6      # the old log-probs are the trainer's
    task = RLTask(loader.rl)
    with torch.no_grad():
        adv = {"advantages": torch.linspace(-1, 1, len(b["labels"]))}     # whatever the rewards were
        s, _ = task.loss(model, b | adv)
        s_off, _ = task.loss(model, {k: v for k, v in b.items() if k != "is_weight"} | adv)
    assert abs(s.item() - s_off.item()) > 0                                # the capped weights change the loss
    sums, top = mismatch_sums(b["old_logps"], b["sampler_logps"], m, sampler_weights(b["old_logps"],
                              b["sampler_logps"], m, mode, 0.999, 1.001)[1], 0.999, 1.001)
    assert abs(top - figs["bf16"]["is_ratio_max"]) < 1e-6 or loader.micro < 8   # one micro-batch is the step here


def test_no_correction_keeps_todays_batches():
    "With the correction off, no sampler log-probs, weights or extra forward: the batch is what it was."
    _, loader = tiny_loader(RLConfig(group_size=4, max_new_tokens=8))
    b = loader.next_batch()
    assert not {"sampler_logps", "is_weight", "old_logps"} & set(b) and "sampler_kl" not in b["stats"]


def guided_batch(loss_type="dapo"):
    "A micro-batch of two groups of 4, the last row of each a reference answer; old log-probs away from the policy's."
    from gradient_garden.config import ModelConfig
    from gradient_garden.models.registry import build_model
    torch.manual_seed(0)
    model = build_model(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, max_seq_len=64))
    prompts = [[1, 5, 9, 11]] * 4 + [[1, 7]] * 4
    outs = [[4, 40, 2], [6, 70, 71, 3], [8, 2], [9, 9, 9, 2], [4, 2], [5, 50, 2], [7, 7, 2], [30, 31, 32, 2]]
    b = collate_rollouts(prompts, outs, 32, 0)
    with torch.no_grad(): lp, _ = completion_logps(model, b)
    g = torch.Generator().manual_seed(5)
    b |= {"advantages": torch.tensor([1., -1, 1, 1, -1, 1, -1, 1]), "keep": torch.ones(8, dtype=torch.bool),
          "off_policy": torch.tensor([False, False, False, True] * 2), "stats": {},
          "old_logps": lp + torch.randn(lp.shape, generator=g) * 0.5}
    return model, b, RLTask(RLConfig(group_size=4, off_policy_rows=1, loss_type=loss_type))


def test_entropy_and_clip_fraction_are_the_sampled_rows():
    model, b, task = guided_batch()
    _, metrics = task.loss(model, b)
    with torch.no_grad(): lp, ent = completion_logps(model, b)
    sampled = (b["labels"] != IGNORE_INDEX) & ~b["off_policy"][:, None]
    ratio, a = torch.exp(lp - b["old_logps"]), b["advantages"][:, None].expand_as(lp)
    clipped = ((ratio < 0.8) & (a < 0)) | ((ratio > 1.2) & (a > 0))
    n = task.count(b)
    assert abs((metrics["entropy"] / n).item() - ent[sampled].mean().item()) < 1e-5
    assert abs((metrics["clip_fraction"] / n).item() - clipped[sampled].double().mean().item()) < 1e-9
    assert clipped[sampled].any() and ent[b["off_policy"]].abs().sum() > 0


@pytest.mark.parametrize("loss_type", RL_LOSSES)
def test_entropy_bonus_moves_only_sampled_tokens(loss_type):
    "The bonus's gradient reaches the logits of sampled positions only; a reference row's get none from it."
    model, b, task = guided_batch(loss_type)
    out = {}
    hook = model.output.register_forward_hook(lambda m, i, o: out.__setitem__("x", o))
    grads = []
    for extra in ({"entropy_coef": 0.5}, {}):
        loss_sum, _ = task.loss(model, b | extra)
        grads.append(torch.autograd.grad(loss_sum, out["x"])[0])
    hook.remove()
    bonus = (grads[0] - grads[1]).abs().sum(-1)                       # [B, T']: the bonus's share of the gradient
    lab = b["labels"][:, b["labels_from"]:] != IGNORE_INDEX
    off = b["off_policy"][:, None].expand_as(lab)
    assert bonus[lab & ~off].min() > 0 and bonus[off].max() == 0


@pytest.mark.parametrize("loss_type", RL_LOSSES)
def test_fillers_leave_every_denominator(loss_type):
    ("A step padded with dynamic sampling's fillers (sampled rows of groups whose rewards agree, out of the loss) "
     "gives the loss and gradient of the step without them.")
    model, b, task = guided_batch(loss_type)
    b = {k: v for k, v in b.items() if k != "off_policy"}
    task = RLTask(RLConfig(group_size=4, loss_type=loss_type))
    pad = {k: torch.cat([v, v[:4]]) if torch.is_tensor(v) and v.dim() else v for k, v in b.items()}
    pad |= {"keep": torch.tensor([True] * 8 + [False] * 4), "filler": torch.tensor([False] * 8 + [True] * 4)}
    grads = []
    for x in (b, pad):
        model.zero_grad()
        s, _ = task.loss(model, x)
        (s / task.count(x)).backward()
        grads.append((s / task.count(x)).item())
        grads.append(model.output.weight.grad.clone())
    assert int(task.count(pad)) == int(task.count(b))
    assert abs(grads[0] - grads[2]) < 1e-6 and (grads[1] - grads[3]).abs().max().item() < 1e-6
