"""The RL stage beyond the notebook: the objective against TRL's own `GRPOTrainer._compute_loss` (loss and gradient,
every normalisation), advantages against TRL's `nanstd`, one-line errors for bad input, and the rollout micro-batches
(whole groups, the trainer's division giving the batch mean)."""
from collections import defaultdict
from types import SimpleNamespace
import pytest
import torch

from gradient_garden.config import ConfigError, GlobalConfig, RLConfig, from_plain
from gradient_garden.checks import validate
from gradient_garden.evals.verifiers import Problem
from gradient_garden.stages.grpo import RL_LOSSES, group_advantages, loss_parts, token_losses
from gradient_garden.stages.rewards import Rewarder, load_prompts
from gradient_garden.stages.rl import RLTask, check_rl_start
from gradient_garden.stages.registry import check_stage, get_stage

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")


def trl_trainer(loss_type, beta, eps_low, eps_high, max_len, entropy_coef=0.0, adaptive: dict | None = None):
    "A `GRPOTrainer` with only what `_compute_loss` reads (`adaptive`: TRL's adaptive entropy settings, control on)."
    t = trl_grpo.GRPOTrainer.__new__(trl_grpo.GRPOTrainer)
    acc = SimpleNamespace(num_processes=1, sync_gradients=True, reduce=lambda x, reduction="sum": x, gather=lambda x: x,
                          gather_for_metrics=lambda x: x)
    t.__dict__.update(top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
                      beta=beta,
                      args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1,
                                           **(adaptive or {})),
                      loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high, use_vllm=False,
                      vllm_importance_sampling_correction=False, current_gradient_accumulation_steps=1,
                      max_completion_length=max_len, accelerator=acc, entropy_coef=entropy_coef,
                      _entropy_bonus_enabled=entropy_coef != 0.0 or adaptive is not None,
                      use_adaptive_entropy=adaptive is not None,
                      _last_world_entropy=float("inf"), _entropy_window_stats=None, aux_loss_enabled=False,
                      _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
                      model=SimpleNamespace(training=True))
    return t


def trl_loss(loss_type, logps, old, ref, adv, mask, beta, eps_low, eps_high, max_len, entropies=None, entropy_coef=0.0,
             t=None):
    ("TRL's `_compute_loss` on given per-token log-probs and entropies (its model forward replaced by them; the rest "
     "is TRL's code).")
    t = t or trl_trainer(loss_type, beta, eps_low, eps_high, max_len, entropy_coef)
    d = t.__dict__
    ents = torch.zeros_like(logps) if entropies is None else entropies
    d["_get_per_token_logps_and_entropies"] = lambda *a, **k: (logps, ents, None)
    B, T = logps.shape
    inputs = dict(prompt_ids=torch.zeros(B, 1, dtype=torch.long), prompt_mask=torch.ones(B, 1, dtype=torch.long),
                  completion_ids=torch.zeros(B, T, dtype=torch.long), completion_mask=mask.long(), advantages=adv,
                  old_per_token_logps=old, ref_per_token_logps=ref, num_items_in_batch=mask.sum())
    return trl_grpo.GRPOTrainer._compute_loss(t, None, inputs)


@pytest.mark.parametrize("loss_type", RL_LOSSES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_and_gradient_equal_trl(loss_type, beta):
    g = torch.Generator().manual_seed(1)
    B, T = 8, 12
    lengths = torch.tensor([12, 1, 5, 7, 12, 3, 9, 2])
    mask = torch.arange(T)[None] < lengths[:, None]
    base = torch.randn(B, T, generator=g) * 0.5 - 1.5
    old = base + torch.randn(B, T, generator=g) * 0.3      # off-policy: ratios on both sides of the clip range
    ref = base + torch.randn(B, T, generator=g) * 0.2
    rewards = torch.tensor([1., 0, 1, 1, 0, 0, 1, 0])
    adv = group_advantages(rewards, 4)[0]
    ours_lp, trl_lp = base.clone().requires_grad_(), base.clone().requires_grad_()
    per_token, _, _ = token_losses(ours_lp, old, adv, 0.2, 0.28, beta, ref)
    s, n = loss_parts(per_token, mask, loss_type, T)
    ours = s / n
    theirs = trl_loss(loss_type, trl_lp, old, ref, adv, mask, beta, 0.2, 0.28, T)
    ours.backward(); theirs.backward()
    assert abs(ours.item() - theirs.item()) < 1e-6
    assert (ours_lp.grad - trl_lp.grad).abs().max().item() < 1e-6
    assert ours_lp.grad.abs().sum() > 0


@pytest.mark.parametrize("loss_type", RL_LOSSES)
def test_entropy_bonus_equals_trl(loss_type):
    ("rl.entropy_coef: the loss minus coef x the mean completion-token entropy, and its gradient, as TRL's "
     "`entropy_coef`.")
    from gradient_garden.stages.grpo import entropy_sum
    g = torch.Generator().manual_seed(2)
    B, T, coef = 8, 10, 0.03
    mask = torch.arange(T)[None] < torch.tensor([10, 1, 4, 7, 10, 3, 9, 2])[:, None]
    base = torch.randn(B, T, generator=g) * 0.5 - 1.5
    old = base + torch.randn(B, T, generator=g) * 0.3
    ent0 = torch.rand(B, T, generator=g) * 2
    adv = group_advantages(torch.tensor([1., 0, 1, 1, 0, 0, 1, 0]), 4)[0]
    ours_lp, trl_lp, ours_ent, trl_ent = (t.clone().requires_grad_() for t in (base, base, ent0, ent0))
    s, n = loss_parts(token_losses(ours_lp, old, adv, 0.2, 0.28)[0], mask, loss_type, T)
    ours = (s - coef * entropy_sum(ours_ent, mask, n)) / n
    theirs = trl_loss(loss_type, trl_lp, old, None, adv, mask, 0.0, 0.2, 0.28, T, trl_ent, coef)
    ours.backward(); theirs.backward()
    assert abs(ours.item() - theirs.item()) < 1e-6
    assert (ours_lp.grad - trl_lp.grad).abs().max().item() < 1e-6
    assert (ours_ent.grad - trl_ent.grad).abs().max().item() < 1e-7 and ours_ent.grad.abs().sum() > 0


@pytest.mark.parametrize("loss_type", RL_LOSSES)
def test_adaptive_entropy_equals_trl(loss_type):
    """rl.use_adaptive_entropy: over steps whose entropy crosses the target both ways and hits both bounds, the applied
    bonus (loss and gradient) and the coefficient equal TRL's `use_adaptive_entropy` control, step by step."""
    from gradient_garden.stages.grpo import entropy_sum
    from gradient_garden.stages.rl_rollouts import EntropyControl
    g = torch.Generator().manual_seed(3)
    B, T = 8, 10
    mask = torch.arange(T)[None] < torch.tensor([10, 1, 4, 7, 10, 3, 9, 2])[:, None]
    base = torch.randn(B, T, generator=g) * 0.5 - 1.5
    old = base + torch.randn(B, T, generator=g) * 0.3
    adv = group_advantages(torch.tensor([1., 0, 1, 1, 0, 0, 1, 0]), 4)[0]
    settings = dict(entropy_target=0.5, entropy_coef_delta=0.02, entropy_coef_min=0.0, entropy_coef_max=0.05)
    t = trl_trainer(loss_type, 0.0, 0.2, 0.28, T, entropy_coef=0.01, adaptive=settings)
    ctl = EntropyControl(0.01, *settings.values())
    coefs = []
    for level in [0.9, 0.3, 0.2, 0.1, 0.2, 0.9, 1.2, 0.3, 0.8, 1.0, 1.1, 0.2]:
        ent0 = torch.rand(B, T, generator=g) * 2 * level
        ours_lp, trl_lp, ours_ent, trl_ent = (x.clone().requires_grad_() for x in (base, base, ent0, ent0))
        s, n = loss_parts(token_losses(ours_lp, old, adv, 0.2, 0.28)[0], mask, loss_type, T)
        ours = (s - ctl.applied() * entropy_sum(ours_ent, mask, n)) / n
        ctl.update(((ent0 * mask).sum() / mask.sum()).item())
        theirs = trl_loss(loss_type, trl_lp, old, None, adv, mask, 0.0, 0.2, 0.28, T, trl_ent, t=t)
        ours.backward(); theirs.backward()
        assert abs(ours.item() - theirs.item()) < 1e-6
        assert (ours_lp.grad - trl_lp.grad).abs().max().item() < 1e-6
        assert (ours_ent.grad - trl_ent.grad).abs().max().item() < 1e-7
        assert abs(ctl.coef - t.entropy_coef) < 1e-12 and ctl.last == t._last_world_entropy
        coefs.append(round(ctl.coef, 3))
    # both bounds reached, several levels between
    assert 0.05 in coefs and 0.0 in coefs and len(set(coefs)) >= 4, coefs


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
def test_logps_at_the_sampling_temperature_equal_trl(temperature):
    ("completion_logps scores each label (and the entropy) under the logits / rl.temperature, as TRL's "
     "`selective_log_softmax_and_entropy`.")
    from trl.trainer.utils import selective_log_softmax_and_entropy
    from gradient_garden.config import ModelConfig
    from gradient_garden.models.registry import build_model
    from gradient_garden.stages.base import IGNORE_INDEX
    from gradient_garden.stages.grpo import collate_rollouts, completion_logps
    torch.manual_seed(0)
    model = build_model(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, max_seq_len=64))
    b = collate_rollouts([[1, 5, 9, 11], [1, 7]], [[4, 40, 2], [6, 70, 71, 3]], 32, 0)
    ours_lp, ours_ent = completion_logps(model, b, temperature=temperature)
    with torch.no_grad(): logits = model(b["input_ids"]).float()
    mask = b["labels"] != IGNORE_INDEX
    trl_lp, trl_ent = selective_log_softmax_and_entropy(logits, b["labels"].clamp(min=0), temperature=temperature)
    assert (ours_lp - trl_lp)[mask].abs().max().item() < 1e-5
    assert (ours_ent - trl_ent)[mask].abs().max().item() < 1e-5
    assert mask.sum() == 7 and (ours_lp[~mask] == 0).all()


def test_advantages_equal_trl_formula():
    from trl.trainer.utils import nanstd
    r = torch.tensor([1., 0, 0, 1, .5, .2, .9, .1])
    want = (r.view(-1, 4) - r.view(-1, 4).mean(1, keepdim=True)) / (nanstd(r.view(-1, 4), dim=1)[:, None] + 1e-4)
    assert torch.allclose(group_advantages(r, 4)[0], want.flatten(), atol=1e-6)
    mean_only = group_advantages(r, 4, "none")[0]
    assert torch.allclose(mean_only, (r.view(-1, 4) - r.view(-1, 4).mean(1, keepdim=True)).flatten())


def test_zero_variance_groups_contribute_nothing_and_never_nan():
    adv, zero = group_advantages(torch.tensor([0.3] * 8), 4)
    assert zero.all() and (adv == 0).all()
    lp = torch.full((8, 4), -1.0, requires_grad=True)
    mask = torch.ones(8, 4, dtype=torch.bool)
    for lt in RL_LOSSES:
        s, n = loss_parts(token_losses(lp, lp.detach(), adv)[0], mask, lt, 4)
        assert torch.isfinite(s) and s.item() == 0.0
        assert (torch.autograd.grad(s, lp)[0] == 0).all()


# -- bad input, one line each ------------------------------------------------------------------------------------------
def _one_line(e): assert "\n" not in str(e.value) and "Traceback" not in str(e.value)

def checked(cfg): return check_stage(validate(cfg))   # the config's checks, then the rl stage's own


def test_group_size_below_two_is_one_line():
    cfg = from_plain(GlobalConfig,
                     {"training": {"stage": "rl", "seq_len": 64, "total_batch_size": 64 * 8, "micro_batch_size": 8},
                                    "rl": {"group_size": 1}})
    with pytest.raises(ConfigError, match=r"rl.group_size: got 1; must be >= 2") as e: checked(cfg)
    _one_line(e)


def test_rows_must_be_whole_groups_and_no_prefetch():
    d = {"training": {"stage": "rl", "seq_len": 64, "total_batch_size": 64 * 12, "micro_batch_size": 4},
         "rl": {"group_size": 8}}
    with pytest.raises(ConfigError, match="whole groups"): checked(from_plain(GlobalConfig, d))
    d["training"]["total_batch_size"] = 64 * 16
    with pytest.raises(ConfigError,
                       match="runtime.num_workers"): checked(from_plain(GlobalConfig,
                                                                        d | {"runtime": {"num_workers": 2}}))


@pytest.mark.parametrize("stage", [None, "pretraining"])
def test_start_without_chat_format_is_one_line(stage):
    cfg = GlobalConfig()
    ckpt = None if stage is None else {"stage": stage}
    start = None if stage is None else get_stage(stage)
    with pytest.raises(ConfigError, match="starts from a chat model") as e: check_rl_start(cfg, ckpt, start)
    _one_line(e)
    cfg.rl.plain_prompts = True
    check_rl_start(cfg, ckpt, start)               # the stated plain-prompt mode
    check_rl_start(GlobalConfig(), {"stage": "instruct"}, get_stage("instruct"))


def bad_reward_raises(prompt, completion, **fields): raise RuntimeError("boom")
def bad_reward_nan(prompt, completion, **fields): return float("nan")
def bad_reward_str(prompt, completion, **fields): return "1.0"
def good_reward(prompt, completion, answer, **fields): return float(answer in completion)


@pytest.mark.parametrize("name,match", [("test_rl:missing_fn", "has no function 'missing_fn'"),
                                        ("no_such_module_rl:f", "cannot import module 'no_such_module_rl'"),
                                        ("not-a-path", "expected 'module:function'")])
def test_missing_reward_function_is_one_line(name, match):
    with pytest.raises(ConfigError, match=match) as e: Rewarder(functions=(name,))
    _one_line(e)


@pytest.mark.parametrize("fn,match",
                         [("bad_reward_raises", "raised RuntimeError: boom"), ("bad_reward_nan", "returned nan"),
                                      ("bad_reward_str", "returned '1.0'")])
def test_bad_reward_values_are_one_line(fn, match):
    r = Rewarder(functions=(f"test_rl:{fn}",))
    ex = Problem("verifiable", "add", "What is 2 + 3?", "5", {"answer": "5"})
    with pytest.raises(ConfigError, match=f"test_rl:{fn} {match}") as e: r(ex, "5", True)
    _one_line(e)


def test_user_reward_gets_prompt_completion_and_fields():
    r = Rewarder(functions=("test_rl:good_reward",))
    ex = Problem("verifiable", "add", "What is 2 + 3?", "5", {"answer": "5", "task": "add"})
    assert r(ex, "it is 5", True) == {"correct": 0.0, "test_rl:good_reward": 1.0, "total": 1.0}


def test_gsm8k_schema_rows_from_a_local_file(tmp_path):
    rows = [{"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
            {"question": "A box holds 1,200 pens; half are sold. How many are left?",
             "answer": "1200/2 = 600\n#### 600"}]
    import json
    f = tmp_path/"gsm8k.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    exs = load_prompts([{"type": "gsm8k", "path": str(f)}])
    assert [e.answer.split("####")[-1].strip() for e in exs] == ["7", "600"]
    r = Rewarder(format_weight=0.5)
    assert r(exs[1], "They sell 600, so 600 are left.\n#### 600", True) == {"correct": 1.0, "format": 1.0, "total": 1.5}
    assert r(exs[0], "8", True)["total"] == 0.0
    bad = tmp_path/"bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no final"}) + "\n")
    with pytest.raises(ConfigError,
                       match=r"row 0 answer does not end in '#### <number>'"): load_prompts([{"type": "gsm8k",
                                                                                              "path": str(bad)}])


def test_124m_gsm8k_recipe_prepares_offline_from_rows_in_gsm8k_schema(tmp_path):
    "The real-scale recipe validates, and its prompts prepare from local files in GSM8K's exact schema (no hub)."
    import json
    from gradient_garden.recipes import load_config
    from gradient_garden.evals.generative import heldout_examples_for
    from gradient_garden.evals.verifiers import gsm8k_match
    cfg, rec = load_config(recipe="recipes/rl/tendril-124m-gsm8k.yaml", world_size=8)
    assert cfg.training.stage == "rl" and cfg.rl.group_size == 8 and rec.data["sources"][0]["type"] == "gsm8k"
    rows = [{"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
                         "May. "
                         "How many clips did Natalia sell altogether in April and May?",
             "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
                       "altogether in April and May.\n#### 72"}]
    for split in ("train", "test"): (tmp_path/f"{split}.jsonl").write_text(json.dumps(rows[0]) + "\n")
    src = dict(rec.data["sources"][0], path=str(tmp_path/"train.jsonl"), val_split=str(tmp_path/"test.jsonl"))
    train, val = load_prompts([src]), heldout_examples_for([src])
    assert len(train) == 1 and len(val) == 1 and gsm8k_match("They sold 72 clips.\n#### 72", val[0].answer)


# -- ranks: a fixed set of rollouts gives one process's loss and gradient
# ------------------------------------------------
def _fixed_loader(rank, world, seed=0):
    ("A rollout loader over 8 prompts (G 4, 32 rows per step) whose completions and rewards are fixed functions of the "
     "prompt.")
    from gradient_garden.config import ModelConfig
    from gradient_garden.models.registry import build_model
    from gradient_garden.stages.rl_rollouts import RolloutLoader
    torch.manual_seed(seed)
    model = build_model(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, max_seq_len=64))
    tok = SimpleNamespace(eot_id=2, eos_id=None, pad_id=0, encode=lambda s: [], decode=lambda ids: "x" * len(ids),
                          render_chat=lambda msgs,
                          add_generation_prompt=True: ([1] + [3 + ord(c) % 80 for c in msgs[0]["content"][:9]], None))
    exs = [Problem("verifiable", "add", f"What is {i} + {i}?", str(2 * i)) for i in range(8)]
    rl = RLConfig(group_size=4, loss_type="dapo", max_new_tokens=8, use_adaptive_entropy=True, entropy_target=0.5,
                  entropy_coef_delta=0.05)
    loader = RolloutLoader(model, tok, exs, rl, None, 32, 32 // world // 2, 2, rank, world, seed=3)
    def sample(idx):
        outs = [[10 + (i * 7 + g * 3) % 50] * (1 + (i + g) % 5) + [2] for i in idx for g in range(4)]
        return (outs, [True] * len(outs), 0.0, torch.tensor([0.3 * len(o) for o in outs], dtype=torch.float64),
                [None] * len(outs))
    loader._sample = sample
    loader.rewarder = LengthReward()
    return model, loader, RLTask(rl)


class LengthReward(Rewarder):
    "Right (1) when the answer's length is a multiple of 3: a reward a random model's samples differ in."
    def __init__(self): super().__init__()
    def __call__(self, ex, text, stopped): c = float(len(text) % 3 == 0); return {"correct": c, "total": c}


def _step_sums(model, loader, task, steps=2):
    """Summed loss, count and gradient of `steps` steps' micro-batches on this rank (no update between them). The
    sampled entropy is 0.3 a token, under the adaptive control's target: the second step's loss has the bonus, 0.05."""
    total, count = 0.0, 0.0
    for _ in range(2 * steps):
        b = loader.next_batch()
        s, _ = task.loss(model, b)
        s.backward()
        total, count = total + s.item(), count + float(task.count(b))
    assert b["entropy_coef"] == 0.05
    return torch.tensor([total, count]), model.output.weight.grad.clone()


def _rl_ranks_worker(rank, world, out_dir):
    import os
    import torch.distributed as dist
    model, loader, task = _fixed_loader(rank, world)
    sums, grad = _step_sums(model, loader, task)
    dist.all_reduce(sums); dist.all_reduce(grad)
    torch.save({"loss": sums[0] / sums[1], "grad": grad / sums[1]}, os.path.join(out_dir, f"r{rank}.pt"))


@pytest.mark.slow
def test_fixed_rollouts_on_two_gloo_ranks_match_one_process(tmp_path):
    import torch.distributed as dist
    if not dist.is_available(): pytest.skip("torch without distributed")
    from gloo_ranks import run_ranks
    run_ranks(_rl_ranks_worker, 2, tmp_path/"pg", str(tmp_path))
    r = [torch.load(tmp_path/f"r{i}.pt") for i in range(2)]
    model, loader, task = _fixed_loader(0, 1)
    sums, grad = _step_sums(model, loader, task)
    assert abs(r[0]["loss"].item() - (sums[0] / sums[1]).item()) < 1e-5
    assert (r[0]["grad"] - grad / sums[1]).abs().max().item() < 1e-5 and grad.abs().sum() > 0


def test_gg_evaluate_generative_flags():
    "gg evaluate accepts --exact-match / --gsm8k as something to evaluate, and refuses them on a Hugging Face folder."
    import argparse
    from gradient_garden.cli.evaluate import add_evaluate_args, evaluation_plan, generative_exact_match, generative_sets
    p = add_evaluate_args(argparse.ArgumentParser())
    args = p.parse_args(["--checkpoint", "c.pt", "--exact-match", "--gsm8k", "g.jsonl", "--pass-k", "8"])
    assert generative_sets(args) == ["exact_match", "gsm8k"] and evaluation_plan(args) == ([], [])
    hf = p.parse_args(["--hf-checkpoint", "d", "--exact-match"])
    with pytest.raises(ConfigError, match="need --checkpoint"): generative_exact_match(hf, None, None, GlobalConfig(),
                                                                                       None)


@pytest.mark.parametrize("setting,message", [({"sampling_rounds": 0}, r"rl.sampling_rounds: got 0"),
                                             ({"task_focus": 1.5}, r"rl.task_focus: got 1.5; must be in \[0, 1\]"),
                                             ({"task_focus": -0.1}, r"rl.task_focus: got -0.1"),
                                             ({"temperature": 0.0}, r"rl.temperature: got 0.0; must be > 0")])
def test_sampling_settings_out_of_range_are_one_line(setting, message):
    cfg = from_plain(GlobalConfig,
                     {"training": {"stage": "rl", "seq_len": 64, "total_batch_size": 64 * 8, "micro_batch_size": 8},
                                    "rl": setting})
    with pytest.raises(ConfigError, match=message) as e: checked(cfg)
    _one_line(e)


# -- off-policy guidance (LUFFY): reference rows in the group ----------------------------------------------------------
def _luffy_plain(rewards, logps, old, mask, G, k, kind, gamma, eps_low, eps_high, weight=1.0):
    ("LUFFY's mixed objective written out row by row: the sampled rows' mean and std (1 where they agree) as the "
     "baseline, clipped ratios on sampled rows, -w A p/(p+gamma) (or -w A log p) on reference rows, the mean over "
     "every token.")
    import math
    total, tokens = 0.0, 0
    for g0 in range(0, len(rewards), G):
        sampled = rewards[g0:g0 + G - k]
        mean = sum(sampled) / len(sampled)
        std = math.sqrt(sum((x - mean) ** 2 for x in sampled) / (len(sampled) - 1))
        for j in range(G):
            row = g0 + j
            a = 0.0 if (std == 0 and j < G - k) else (rewards[row] - mean) / ((std if std else 1.0) + 1e-4)
            for t in range(logps.shape[1]):
                if not mask[row, t]: continue
                if j >= G - k and kind == "log_likelihood": total = total - weight * a * logps[row, t]
                elif j >= G - k:
                    p = logps[row, t].exp()
                    total = total - weight * a * p / (p + gamma)
                else:
                    r = (logps[row, t] - old[row, t]).exp()
                    total = total - torch.min(r * a, r.clamp(1 - eps_low, 1 + eps_high) * a)
                tokens += 1
    return total / tokens


@pytest.mark.parametrize("kind,gamma,weight",
                         [("shaped", 0.1, 1.0), ("shaped", 0.5, 1.0), ("log_likelihood", 0.1, 1.0),
                          ("log_likelihood", 0.1, 6.0)])
def test_guided_loss_equals_luffy_written_out(kind, gamma, weight):
    ("rl.off_policy_rows: advantages, the shaped unclipped term on reference rows and the clipped one on sampled rows "
     "(dapo), loss and gradient.")
    from gradient_garden.stages.rl_rollouts import with_references
    g = torch.Generator().manual_seed(4)
    G, k, B, T = 4, 1, 12, 6
    # samples all fail / differ / all right (and the reference too)
    rewards = [0., 0, 0, 1, 1, 0, 1, 1, 1, 1, 1, 1]
    mask = torch.arange(T)[None] < torch.tensor([6, 1, 3, 4, 6, 2, 5, 3, 2, 6, 4, 5])[:, None]
    base = (torch.randn(B, T, generator=g, dtype=torch.float64) * 0.8 - 1.2).clamp(max=-0.01)
    old = base + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    adv, _ = group_advantages(torch.tensor(rewards, dtype=torch.float64), G, n_off=k)
    off = (torch.arange(G) >= G - k).repeat(B // G)
    rl = RLConfig(group_size=G, off_policy_rows=k, off_policy_loss=kind, off_policy_shaping=gamma,
                  off_policy_weight=weight)
    ours_lp, plain_lp = base.clone().requires_grad_(), base.clone().requires_grad_()
    per_token, ratio, kl = token_losses(ours_lp, old, adv, 0.2, 0.28)
    per_token, ratio = with_references(per_token, ratio, kl, ours_lp, adv, off, rl)
    s, n = loss_parts(per_token, mask, "dapo", T)
    ours, plain = s / n, _luffy_plain(rewards, plain_lp, old, mask, G, k, kind, gamma, 0.2, 0.28, weight)
    ours.backward(); plain.backward()
    assert abs(ours.item() - plain.item()) < 1e-12
    assert (ours_lp.grad - plain_lp.grad).abs().max().item() < 1e-12
    # failed samples: only the reference teaches
    assert ours_lp.grad[3].abs().sum() > 0 and (ours_lp.grad[:3] == 0).all()
    assert (ours_lp.grad[8:] == 0).all()                                        # all right, reference too: nothing
    assert (ratio[off] == 1).all()


def test_guided_gsm8k_reference_is_the_worked_answer_and_passes_the_verifier(tmp_path):
    ("A GSM8K row's reference completion is its whole worked answer as the assistant turn; the numeric verifier "
     "accepts it.")
    from gradient_garden.stages.rl_rollouts import reference_completion
    tok = SimpleNamespace(eot_id=2, eos_id=3, encode=lambda s: [ord(c) for c in s],
                          decode=lambda ids: "".join(chr(i) for i in ids),
                          render_chat=lambda msgs, add_generation_prompt=False: (
                              [1, 9] + [ord(c) for c in msgs[0]["content"]] + [2,
                                                                               9] + [ord(c)
                                                                                     for c in msgs[1]["content"]] + [2],
                              [0, 0] + [0] * len(msgs[0]["content"]) + [0, 0] + [1] * (len(msgs[1]["content"]) + 1)))
    ex = Problem("gsm8k", "gsm8k", "Tom has 3 apples and buys 4 more. How many?", "3 + 4 = <<3+4=7>>7\n#### 7")
    ref = reference_completion(tok, ex)
    assert ref[-1] == 2 and tok.decode(ref[:-1]) == ex.answer
    assert Rewarder()(ex, tok.decode(ref[:-1]), True)["correct"] == 1.0
    assert reference_completion(tok, ex, plain=True) == [ord(c) for c in ex.answer] + [3]


@pytest.mark.parametrize("setting,message", [({"group_size": 4, "off_policy_rows": 3}, r"rl.off_policy_rows: got 3; "
                                                                                       r"must be in \[0, rl.group_size "
                                                                                       r"- 2 = 2\]"),
                                             ({"off_policy_shaping": 0.0},
                                              r"rl.off_policy_shaping: got 0.0; must be > 0"),
                                             ({"off_policy_weight": -1.0},
                                              r"rl.off_policy_weight: got -1.0; must be >= 0")])
def test_guidance_settings_out_of_range_are_one_line(setting, message):
    with pytest.raises(ConfigError,
                       match=message) as e: checked(from_plain(GlobalConfig,
                                                               {"training": {"stage": "rl", "seq_len": 64,
                                                                             "total_batch_size": 64 * 8,
                                                                             "micro_batch_size": 8}, "rl": setting}))
    _one_line(e)


def test_failure_stack_is_in_the_loader_state_and_loads_weights_only(tmp_path):
    "rl.off_policy_prompts: failed: the stack of failed prompts survives a checkpoint (weights_only=True) and a resume."
    _, loader, _ = _fixed_loader(0, 1)
    loader.failed = [(3, 1.0), (5, 1.1)]
    torch.save(loader.state_dict(), tmp_path/"state.pt")
    _, again, _ = _fixed_loader(0, 1)
    again.load_state_dict(torch.load(tmp_path/"state.pt", weights_only=True))
    assert again.failed == [(3, 1.0), (5, 1.1)]
