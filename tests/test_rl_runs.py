"""The RL stage run by the trainer at small scale: exact resume (weights and rollout sampling), FSDP2 on 2 gloo ranks,
and activation checkpointing, torch.compile and LoRA composed with it. A tiny BPE trained on the verifiable chats and
a random two-layer Tendril prompted in the plain mode (`rl.plain_prompts`: no chat checkpoint needed)."""
import json, os
from pathlib import Path
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def parity_reward(prompt, completion, **fields):
    ("A reward a random model's samples differ in (the parity of the completion's length), so every group has a "
     "gradient.")
    return float(len(completion) % 2)
RECIPE = str(ROOT/"recipes"/"rl"/"debug.yaml")


@pytest.fixture(scope="module")
def rl_inputs(tmp_path_factory):
    ("A 768-token BPE and the RL prompts (train and held-out) prepared with it; returns the overrides that point at "
     "them.")
    from gradient_garden.recipes import load_config
    from gradient_garden.data.verifiable import WORDS, sample_conversations
    from gradient_garden.stages.rl import prepare_rl, rl_dir
    from gradient_garden.tokenizer import train_bpe
    base = tmp_path_factory.mktemp("rl_inputs")
    texts = [m["content"] for c in sample_conversations(300, seed=0) for m in c] + [" ".join(WORDS)] * 2
    tok = train_bpe(texts, 768, base/"tok")
    sets = [f"tokenizer.path={tok}", f"paths.datasets={base/'datasets'}", "rl.eval_per_task=2"]
    cfg, _ = load_config(recipe=RECIPE, overrides=sets)
    prepare_rl({"sources": [{"type": "verifiable", "train": 64, "tasks": ["add", "first_letter"], "seed": 0}]}, cfg,
               rl_dir(cfg), progress=False)
    return sets


def small(rl_inputs, out: Path, **extra) -> list[str]:
    """2 layers of 64, plain prompts, G 4 (one row a failed prompt's reference answer, the recipe's guidance scaled
    down), 16 rows per step (4 prompts) in micro-batches of 8, 6 new tokens, fp32 on the CPU, 4 steps, checkpoints every
    2 (all kept), validation (held-out exact match) every 2."""
    s = {"paths.runs": out/"runs", "model.dim": 64, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2,
         "model.vocab_size": 768, "model.max_seq_len": 64, "training.seq_len": 32, "training.micro_batch_size": 8,
         "training.total_batch_size": 32 * 16, "training.max_steps": 4, "training.log_every": 1, "rl.group_size": 4,
         "rl.off_policy_rows": 1, "rl.max_new_tokens": 6, "rl.plain_prompts": "true", "rl.temperature": 1.0,
         "rl.eval_k": 2, "rl.beta": 0.0, "rl.reward_functions": '["test_rl_runs:parity_reward"]',
         "optimizers.adamw.max_lr": 3e-3, "optimizers.adamw.warmup_steps": 1, "validation.every": 2,
         "checkpointing.every": 2, "checkpointing.keep_last": 10, "runtime.device": "cpu", "runtime.precision": "fp32",
         **extra}
    return rl_inputs + [f"{k}={v}" for k, v in s.items()]


def train(overrides, checkpoint=None, world: int = 1):
    from gradient_garden.recipes import load_config
    from gradient_garden.train.run import run_training
    cfg, _ = load_config(recipe=RECIPE, overrides=overrides, world_size=world)
    return run_training(cfg, checkpoint=checkpoint)


def records(out: Path) -> dict:
    "step -> the training record of the run under `out`."
    recs = [json.loads(l) for l in (out/"runs"/"rl"/"debug"/"metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in recs if "loss" in r}


def last_weights(out: Path) -> dict:
    from gradient_garden.checkpoint.checkpoints import load_checkpoint
    ck = sorted((out/"runs"/"rl"/"debug"/"checkpoints").glob("step_*"))[-1]
    return load_checkpoint(ck)["model"]


ROLLOUT_FIGURES = ("reward_mean", "reward_std", "zero_std_groups", "completion_len", "entropy", "clip_fraction", "loss")


ADAPTIVE = {"rl.use_adaptive_entropy": "true", "rl.entropy_target": 100.0, "rl.entropy_coef_delta": 0.01}


def test_resume_is_bit_exact_weights_and_rollouts(rl_inputs, tmp_path):
    """Resumed from its step-2 checkpoint, the run samples the same rollouts and ends with the same weights, bit for
    bit; the adaptive entropy control (on here, its target above any entropy) continues where it stood."""
    from gradient_garden.checkpoint.checkpoints import load_checkpoint
    full, resumed = tmp_path/"full", tmp_path/"resumed"
    train(small(rl_inputs, full, **ADAPTIVE))
    ckpt = full/"runs"/"rl"/"debug"/"checkpoints"/"step_0000002.pt"
    assert ckpt.is_file()
    train(small(rl_inputs, resumed, **ADAPTIVE), checkpoint=ckpt)
    a, b = records(full), records(resumed)
    assert sorted(b) == [3, 4]
    for s in b:
        for k in ROLLOUT_FIGURES + ("entropy_coef",): assert a[s][k] == b[s][k], (s, k, a[s][k], b[s][k])
    assert [round(a[s]["entropy_coef"], 6) for s in (1, 2, 3, 4)] == [0, 0.01, 0.02, 0.03]
    wa, wb = last_weights(full), last_weights(resumed)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], v) for k, v in load_checkpoint(ckpt)["model"].items())   # steps 3-4 changed them
    ck = load_checkpoint(ckpt)
    rounds = a[1]["sampling_rounds"] + a[2]["sampling_rounds"]     # the recipe's dynamic sampling: 1 to 4 rounds a step
    assert (ck.get("loaders") or [ck.get("loader")])[0]["round"] == rounds and a[3]["reward_std"] > 0


def test_resume_refuses_another_group_size(rl_inputs, tmp_path):
    from gradient_garden.config import ConfigError
    train(small(rl_inputs, tmp_path, **{"training.max_steps": 2}))
    ckpt = tmp_path/"runs"/"rl"/"debug"/"checkpoints"/"step_0000002.pt"
    with pytest.raises(ConfigError, match="loader state: group_size was 4 when saved, is 8 now"):
        train(small(rl_inputs, tmp_path/"other", **{"rl.group_size": 8}), checkpoint=ckpt)


def _fsdp_world(rank, world, overrides):
    train(overrides, world=world)


@pytest.mark.slow
def test_fsdp2_rl_run_on_two_gloo_ranks(rl_inputs, tmp_path):
    "FSDP2 on 2 ranks: each rank samples its share of the prompts, the run trains, validates and checkpoints."
    from gloo_ranks import run_ranks
    run_ranks(_fsdp_world, 2, tmp_path/"init",
              small(rl_inputs, tmp_path, **{"runtime.fsdp": "true", "checkpointing.format": "sharded"}))
    recs = records(tmp_path)
    assert sorted(recs) == [1, 2, 3, 4]
    for r in recs.values():
        assert all(torch.isfinite(torch.tensor(float(r[k]))) for k in ROLLOUT_FIGURES)
        assert r["rollout_tokens_per_s"] > 0 and "update_tokens_per_s" in r
    vals = [json.loads(l) for l in (tmp_path/"runs"/"rl"/"debug"/"metrics.jsonl").read_text().splitlines()]
    assert any("val_exact_match" in v for v in vals)
    assert (tmp_path/"runs"/"rl"/"debug"/"checkpoints"/"step_0000004").is_dir()


def test_activation_checkpointing_gives_the_same_run(rl_inputs, tmp_path):
    "Full activation checkpointing recomputes the same forward: the same rollouts and losses as without it."
    plain, ac = tmp_path/"plain", tmp_path/"ac"
    train(small(rl_inputs, plain, **{"training.max_steps": 2, "checkpointing.every": 0}))
    train(small(rl_inputs, ac,
                **{"training.max_steps": 2, "checkpointing.every": 0, "runtime.activation_checkpointing": "full"}))
    a, b = records(plain), records(ac)
    for s in (1, 2):
        assert a[s]["reward_mean"] == b[s]["reward_mean"]
        assert abs(a[s]["loss"] - b[s]["loss"]) <= 1e-6 * max(1.0, abs(a[s]["loss"])), (s, a[s]["loss"], b[s]["loss"])


def test_lora_trains_only_the_adapters(rl_inputs, tmp_path):
    "With LoRA the RL stage runs and trains the adapters (their B matrices start at zero)."
    train(small(rl_inputs, tmp_path, **{"training.max_steps": 2, "lora.enabled": "true", "lora.rank": 4}))
    recs = records(tmp_path)
    assert sorted(recs) == [1, 2] and all(torch.isfinite(torch.tensor(r["loss"])) for r in recs.values())
    from gradient_garden.checkpoint.checkpoints import load_checkpoint
    ck = load_checkpoint(tmp_path/"runs"/"rl"/"debug"/"checkpoints"/"step_0000002.pt")
    lora = [k for k in ck["model"] if "lora_" in k]
    assert lora, "no adapter weights in the checkpoint"
    assert any(ck["model"][k].abs().sum() > 0 for k in lora if "lora_B" in k)   # B starts at zero: it was trained


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("GG_HEAVY") != "1",
                    reason="GG_HEAVY=1: compiling the blocks takes minutes on 2 cores")
def test_compiled_blocks_follow_eager(rl_inputs, tmp_path):
    "`runtime.compile=true` (each block compiled): the same rollouts at step 1 and losses within 1e-4 of eager."
    eager, compiled = tmp_path/"eager", tmp_path/"compiled"
    train(small(rl_inputs, eager, **{"training.max_steps": 2, "checkpointing.every": 0, "validation.enabled": "false"}))
    train(small(rl_inputs, compiled,
                **{"training.max_steps": 2, "checkpointing.every": 0, "validation.enabled": "false",
                                        "runtime.compile": "true"}))
    a, b = records(eager), records(compiled)
    assert a[1]["reward_mean"] == b[1]["reward_mean"] and a[1]["completion_len"] == b[1]["completion_len"]
    for s in (1, 2): assert abs(a[s]["loss"] - b[s]["loss"]) <= 1e-4 * max(1.0, abs(a[s]["loss"])), (s, a[s]["loss"],
                                                                                                     b[s]["loss"])


def test_bf16_rollouts_corrected_with_gspo_ratios(rl_inputs, tmp_path):
    ("An fp32 run whose rollouts decode in bf16 (`rl.rollout_precision`), corrected by TRL's sequence-level masked "
     "importance sampling, with GSPO's sequence ratios: each step logs the mismatch and a finite loss.")
    out = tmp_path/"corrected"
    train(small(rl_inputs, out, **{"training.max_steps": 2, "rl.rollout_precision": "bf16", "rl.loss_type": "grpo",
                                   "rl.importance_sampling_correction": "true",
                                   "rl.importance_sampling_level": "sequence"}))
    r = records(out)
    for s in (1, 2):
        assert r[s]["sampler_kl"] > 1e-8 and r[s]["is_ratio_max"] > 1.0 and 0 <= r[s]["is_capped"] <= 1, r[s]
        assert torch.isfinite(torch.tensor(r[s]["loss"]))


ASYNC = {"rl.async_rollouts": "true", "rl.importance_sampling_correction": "true", "rl.sampling_rounds": 1,
         "rl.importance_sampling_mode": "token_truncate"}


def test_async_rollouts_train_and_resume_bit_exact(rl_inputs, tmp_path):
    ("rl.async_rollouts: each step trains on rollouts sampled one update earlier (the mismatch figures show the "
     "staleness from step 2 on); resumed from step 2, whose pending rollouts ride in the checkpoint, the run samples "
     "and ends exactly as the uninterrupted one.")
    full, resumed = tmp_path/"full", tmp_path/"resumed"
    train(small(rl_inputs, full, **ASYNC))
    train(small(rl_inputs, resumed, **ASYNC), checkpoint=full/"runs"/"rl"/"debug"/"checkpoints"/"step_0000002.pt")
    a, b = records(full), records(resumed)
    assert a[1]["sampler_kl"] < 1e-9 < a[2]["sampler_kl"]          # step 1 samples its own weights; then one behind
    for s in (3, 4):
        for k in ROLLOUT_FIGURES + ("sampler_kl",): assert a[s][k] == b[s][k], (s, k, a[s][k], b[s][k])
    wa, wb = last_weights(full), last_weights(resumed)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_step_whose_every_completion_is_cut_off_learns_nothing(rl_inputs, tmp_path):
    """Under `rl.mask_truncated`, a step whose every completion hit the token budget has no token to learn from: its
    loss is zero and the weights stay finite (not 0/0, which made every weight NaN)."""
    out = tmp_path/"cut"
    train(small(rl_inputs, out, **{"rl.mask_truncated": "true", "rl.max_new_tokens": 1, "rl.off_policy_rows": 0,
                                   "training.max_steps": 2, "validation.enabled": "false"}))
    recs = records(out)
    assert sorted(recs) == [1, 2] and all(r["loss"] == 0 for r in recs.values()), recs
    assert all(torch.isfinite(v).all() for v in last_weights(out).values())


def test_train_says_when_the_prepared_prompts_are_not_the_recipes(rl_inputs, capsys):
    """The prompts prepared here (64, two tasks) are not the recipe's (8000, all tasks): `gg train` says so in one line
    on stderr, and says nothing when the recipe's sources are the prepared ones."""
    from gradient_garden.cli.train import warn_prepared_sources
    from gradient_garden.recipes import load_config
    cfg, recipe = load_config(recipe=RECIPE, overrides=rl_inputs)
    note = warn_prepared_sources(cfg, recipe)
    assert '"tasks": ["add", "first_letter"]' in note and '"train": 8000' in note, note
    assert capsys.readouterr().err == f"warning: {note}\n"
    recipe.data = {"sources": [{"type": "verifiable", "train": 64, "tasks": ["add", "first_letter"], "seed": 0}]}
    assert warn_prepared_sources(cfg, recipe) is None and capsys.readouterr().err == ""


def test_best_checkpoint_by_the_validations_exact_match(rl_inputs, tmp_path):
    ("validation.metric: exact_match ranks RL checkpoints by the validation's own held-out exact match "
     "(`val_exact_match`, not a second evaluation); `<run>/best` names the highest, the earliest on ties.")
    from gradient_garden.checkpoint.checkpoints import load_checkpoint, resolve_checkpoint
    train(small(rl_inputs, tmp_path, **{"validation.metric": "exact_match", "checkpointing.keep_last": 1}))
    run = tmp_path/"runs"/"rl"/"debug"
    recs = [json.loads(l) for l in (run/"metrics.jsonl").read_text().splitlines()]
    em = {r["step"]: r["val_exact_match"] for r in recs if "val_exact_match" in r}
    assert sorted(em) == [2, 4]
    best_step = min(s for s in em if em[s] == max(em.values()))
    meta = load_checkpoint(resolve_checkpoint(run/"best"), weights=False)
    assert (meta["step"], meta["best_by"]) == (best_step, -em[best_step])


def letter_is_easy_reward(prompt, completion, **fields):
    "Every first-letter answer earns 1 (its groups never differ); elsewhere the completion length's parity."
    return 1.0 if "first letter" in prompt else parity_reward(prompt, completion)


ANCHORED = {"rl.off_policy_rows": 0, "rl.beta": 0.1, "rl.sampling_rounds": 4,
            "rl.reward_functions": '["test_rl_runs:letter_is_easy_reward"]'}


def test_kl_anchor_groups_train_the_left_out_groups_kl_and_resume_bit_exact(rl_inputs, tmp_path):
    ("rl.kl_anchor_groups: the first-letter groups, always equal, are left out of every step and come back as KL "
     "anchors. Step 1 starts at the reference (KL 0 and no gradient from it), so it equals the run without anchors; "
     "step 2 samples the same rollouts and adds the anchors' KL to its loss, which then moves the weights; resumed "
     "from step 2 the run ends bit-exact.")
    plain, full, resumed = tmp_path/"plain", tmp_path/"full", tmp_path/"resumed"
    train(small(rl_inputs, plain, **ANCHORED))
    train(small(rl_inputs, full, **ANCHORED, **{"rl.kl_anchor_groups": 2}))
    train(small(rl_inputs, resumed, **ANCHORED, **{"rl.kl_anchor_groups": 2}),
          checkpoint=full/"runs"/"rl"/"debug"/"checkpoints"/"step_0000002.pt")
    p, a, b = records(plain), records(full), records(resumed)
    assert all(p[1][k] == a[1][k] for k in ROLLOUT_FIGURES + ("kl",)), [(k, p[1][k], a[1][k]) for k in ROLLOUT_FIGURES]
    assert a[1]["zero_std_groups"] > 0                              # equal groups were sampled: anchors to take
    # step 1's weights are equal, so step 2 samples the same rollouts; its loss adds the anchors' KL, now above 0
    # (the entropy to float rounding: the larger micro-batches hold the same rows padded to other widths)
    assert all(p[2][k] == a[2][k] for k in ROLLOUT_FIGURES if k not in ("loss", "entropy"))
    assert abs(p[2]["entropy"] - a[2]["entropy"]) < 1e-5 and a[2]["loss"] > p[2]["loss"]
    for s in (3, 4):
        for k in ROLLOUT_FIGURES + ("kl",): assert a[s][k] == b[s][k], (s, k, a[s][k], b[s][k])
    wa, wb, wp = last_weights(full), last_weights(resumed), last_weights(plain)
    assert all(torch.equal(wa[k], wb[k]) for k in wa) and any(not torch.equal(wa[k], wp[k]) for k in wa)
