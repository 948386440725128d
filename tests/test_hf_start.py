"""Every stage starts from a Hugging Face folder (`training.init_from: hf:DIR`, `gg train --hf-checkpoint DIR`): a
Qwen3-shaped folder built locally with `transformers` (its tokenizer files beside it) starts SFT, DPO (the reference
is the imported model: the first loss is log 2), distillation (teacher = the same folder: the first KL is 0), RL and
LoRA, each resuming bit-exactly on one process; DDP and FSDP2 on 2 gloo ranks give one process's losses (RL on fixed
completions: its sampler draws per rank); `gg plan` plans it."""
import json, math, shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import ROOT, run_gg
from gradient_garden.checkpoint.checkpoints import load_checkpoint
from gradient_garden.checkpoint.hf import load_hf
from gradient_garden.config import GlobalConfig, TokenizerConfig, from_plain
from gradient_garden.data.verifiable import WORDS, sample_conversations
from gradient_garden.stages.dpo import prepare_dpo
from gradient_garden.stages.rl import prepare_rl
from gradient_garden.stages.sft import prepare_instruct
from gradient_garden.tokenizer import init_tokenizer, train_bpe
from gradient_garden.train.run import run_training

VOCAB, SEQ = 768, 64


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    "A Qwen3 folder (random weights, norm gains drawn, tied embeddings, 32-wide heads) with its tokenizer, and data."
    base = tmp_path_factory.mktemp("hf_start")
    texts = [m["content"] for c in sample_conversations(2000, seed=0) for m in c] + [" ".join(WORDS)] * 3
    tok_dir = train_bpe(texts, VOCAB, base/"tok")
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=SEQ, tie_word_embeddings=True, initializer_range=0.05)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight"): p.normal_(1.0, 0.2)
    folder = base/"Qwen3-tiny"
    hf.save_pretrained(folder)
    shutil.copytree(tok_dir, folder, dirs_exist_ok=True)
    tok = init_tokenizer(TokenizerConfig(path=str(folder)))
    g = GlobalConfig(tokenizer=TokenizerConfig(path=str(folder)))
    g.paths.datasets = str(base/"datasets")
    src = {"type": "verifiable", "train": 200, "val": 20, "seed": 0}
    prepare_instruct({"sources": [src]}, g, base/"datasets"/"instruct", tok, progress=False)
    prepare_dpo({"sources": [dict(src, seed=1)]}, g, base/"datasets"/"dpo", tok, progress=False)
    prepare_rl(None, g, base/"datasets"/"rl", tok, progress=False)
    return dict(base=base, folder=folder, datasets=base/"datasets")


def _cfg(inputs, stage, runs, steps=4, **over) -> GlobalConfig:
    d = {"training": {"stage": stage, "init_from": f"hf:{inputs['folder']}", "max_steps": steps, "seed": 7,
                      "micro_batch_size": 4, "seq_len": SEQ, "total_batch_size": 8 * SEQ, "log_every": 1},
         "optimizers": {"adamw": {"warmup_steps": 1, "max_lr": 1e-3, "min_lr": 1e-4}},
         "validation": {"every": 2, "steps": 1}, "checkpointing": {"every": 2, "keep_last": 5},
         "generation": {"every": 0}, "evals": {"every": 0}, "runtime": {"device": "cpu", "precision": "fp32"},
         "paths": {"datasets": str(inputs["datasets"]), "runs": str(runs)}}
    for k, v in over.items(): d.setdefault(k, {}).update(v)
    return from_plain(GlobalConfig, d)


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir)/"metrics.jsonl").read_text().splitlines()]


def _losses(run_dir) -> dict:
    return {r["step"]: r["loss"] for r in _records(run_dir) if "loss" in r}


_FULL: dict = {}

def _full(inputs, stage, **over) -> GlobalConfig:
    "The 4-step run of `stage` with `over` on one process, made once per module (the resume and FSDP2 tests share it)."
    key = (stage, json.dumps(over, sort_keys=True))
    if key not in _FULL:
        _FULL[key] = _cfg(inputs, stage, inputs["base"]/"full"/str(len(_FULL)), **over)
        run_training(_FULL[key])
    return _FULL[key]


def _full_and_resumed(inputs, tmp_path, stage, **over):
    "Run 4 steps, then again from the step-2 checkpoint; return both runs' configs."
    full = _full(inputs, stage, **over)
    resumed = _cfg(inputs, stage, tmp_path/"resumed", **over)
    run_training(resumed, checkpoint=full.run_dir/"checkpoints"/"step_0000002.pt")
    a, b = _losses(full.run_dir), _losses(resumed.run_dir)
    assert sorted(b) == [3, 4] and all(a[s] == b[s] for s in b), (stage, a, b)
    return full, resumed


def test_sft_starts_from_the_folder_and_resumes_exactly(inputs, tmp_path):
    tiny = {"adamw": {"max_lr": 1e-30, "min_lr": 1e-30}}   # a step of 1e-30 moves no fp32 weight of these sizes
    start = _cfg(inputs, "instruct", tmp_path/"start", steps=1, optimizers=tiny, checkpointing={"every": 1})
    run_training(start)
    saved = load_checkpoint(start.run_dir/"checkpoints"/"step_0000001.pt")
    model, cfg = load_hf(inputs["folder"])
    assert saved["config"]["model"]["hf_model_type"] == "qwen3" and saved["config"]["model"]["head_size"] == 32
    for k, v in model.state_dict().items(): assert torch.equal(saved["model"][k], v), k   # the folder's weights
    _full_and_resumed(inputs, tmp_path, "instruct")


def test_dpo_reference_is_the_imported_model(inputs, tmp_path):
    full, _ = _full_and_resumed(inputs, tmp_path, "dpo")
    assert abs(_losses(full.run_dir)[1] - math.log(2)) < 1e-5   # policy = reference at the first step


def test_distillation_from_the_same_folder_starts_at_zero_kl(inputs, tmp_path):
    over = {"distillation": {"enabled": True, "teacher": str(inputs["folder"]), "alpha": 1.0}}
    full, _ = _full_and_resumed(inputs, tmp_path, "instruct", **over)
    first = _records(full.run_dir)[0]
    kl = next(v for k, v in first.items() if "kl" in k)
    assert abs(kl) < 1e-5, first


def test_rl_starts_from_the_folders_chat_model_and_resumes_exactly(inputs, tmp_path):
    "The folder has a chat template, so it is a chat model RL may start from; 2 groups of 4 completions a step."
    over = {"rl": {"group_size": 4, "max_new_tokens": 8, "mask_truncated": False, "eval_k": 1},
            "validation": {"enabled": False}}
    full, _ = _full_and_resumed(inputs, tmp_path, "rl", **over)
    assert all(math.isfinite(v) for v in _losses(full.run_dir).values())


def test_lora_starts_from_the_folder_and_resumes_exactly(inputs, tmp_path):
    full, _ = _full_and_resumed(inputs, tmp_path, "instruct", lora={"enabled": True, "rank": 4})
    saved = load_checkpoint(full.run_dir/"checkpoints"/"step_0000004.pt")
    assert any(k.endswith("lora_A") for k in saved["model"])


def _cli_sets(inputs, runs, **extra) -> list[str]:
    s = {"paths.runs": runs, "paths.datasets": inputs["datasets"], "training.max_steps": 4, "training.log_every": 1,
         "training.seq_len": SEQ, "training.micro_batch_size": 2, "training.total_batch_size": 8 * SEQ,
         "validation.enabled": "false", "generation.every": 0, "evals.every": 0, "checkpointing.every": 4,
         "runtime.device": "cpu", "runtime.precision": "fp32", "optimizers.adamw.warmup_steps": 1, **extra}
    return [f"{k}={v}" for k, v in s.items()]


@pytest.mark.slow   # about 90 s: three runs, two of them on 2 ranks
def test_ddp_and_fsdp2_on_two_ranks_match_one_process(inputs, tmp_path):
    from test_distributed import assert_close, torchrun
    recipe = ROOT/"recipes"/"instruct"/"debug.yaml"
    run_gg("train", "--recipe", recipe, "--hf-checkpoint", inputs["folder"], "--set",
           *_cli_sets(inputs, tmp_path/"one"))
    one = _losses(tmp_path/"one"/"instruct"/"debug")
    for name, fsdp in (("ddp", "false"), ("fsdp2", "true")):
        torchrun("train", "--recipe", recipe, "--hf-checkpoint", inputs["folder"], "--set",
                 *_cli_sets(inputs, tmp_path/name, **{"runtime.fsdp": fsdp}))
        assert_close(one, _losses(tmp_path/name/"instruct"/"debug"), range(1, 5))


# -- FSDP2 on 2 gloo ranks: DPO, distillation, RL and LoRA from the folder give one process's losses
NUMBERS = "one two three four five six seven eight nine ten".split()


def length_reward(prompt, completion, **fields):
    "1 for a completion of at least 20 characters: five of the numbers below, or more."
    return float(len(completion) >= 20)


def fixed_sample(self, idx, model=None, round_=None):
    """RL completions that are a fixed function of the prompt's index and the row, each ended by the end of turn. The
    sampler seeds its draws per rank, so sampled rollouts differ between world sizes; these do not. Row g of prompt i
    counts to 1 + (3i + 3g) mod 10: every group has rows under and over `length_reward`'s bar and the longer rows earn
    more, so every step's loss is below 0."""
    words = [self.tok.encode(f" {w}") for w in NUMBERS]
    count = lambda i, g: 1 + (3 * i + 3 * g) % len(NUMBERS)
    outs = [sum(words[:count(i, g)], []) + [self.tok.eot_id] for i in idx for g in range(self.rl.group_size)]
    return outs, [True] * len(outs), 0.0, torch.zeros(len(outs), dtype=torch.float64), [None] * len(outs)


def _fsdp2_cases(inputs) -> dict:
    "name -> (stage, overrides) of the runs made on one process and on 2 FSDP2 ranks."
    return {"dpo": ("dpo", {}),
            "distillation": ("instruct", {"distillation": {"enabled": True, "teacher": str(inputs["folder"]),
                                                           "alpha": 0.5}}),   # the loss mixes CE and KL: not 0
            "rl": ("rl", {"rl": {"group_size": 4, "max_new_tokens": 24, "mask_truncated": False, "eval_k": 1,
                                 "reward_functions": ["test_hf_start:length_reward"]},
                          "validation": {"enabled": False}}),
            "lora": ("instruct", {"lora": {"enabled": True, "rank": 4}})}


def _fsdp2_cfg(inputs, stage, name, over) -> GlobalConfig:
    return _cfg(inputs, stage, inputs["base"]/"fsdp2"/name, **over, checkpointing={"every": 0},
                runtime={"device": "cpu", "precision": "fp32", "fsdp": True})


def _fsdp2_world(rank, world, inputs, cases):
    "Rank body: each case in turn on the 2-rank FSDP2 world, RL with the fixed completions."
    from gradient_garden.stages.rl_rollouts import RolloutLoader
    RolloutLoader._sample = fixed_sample
    for name, (stage, over) in cases.items(): run_training(_fsdp2_cfg(inputs, stage, name, over))


@pytest.fixture(scope="module")
def fsdp2_runs(inputs):
    "name -> (one process's losses, 2 FSDP2 ranks' losses); one spawned world runs all four cases."
    from gloo_ranks import run_ranks
    from gradient_garden.stages.rl_rollouts import RolloutLoader
    cases = _fsdp2_cases(inputs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RolloutLoader, "_sample", fixed_sample)
        one = {name: _losses(_full(inputs, stage, **over).run_dir) for name, (stage, over) in cases.items()}
    run_ranks(_fsdp2_world, 2, inputs["base"]/"init_fsdp2", inputs, cases)
    return {name: (one[name], _losses(_fsdp2_cfg(inputs, stage, name, over).run_dir))
            for name, (stage, over) in cases.items()}


@pytest.mark.parametrize("name", ["dpo", "distillation", "rl", "lora"])
def test_fsdp2_on_two_ranks_matches_one_process(fsdp2_runs, name):
    "The imported folder trained by `name` on 2 FSDP2 ranks (1 micro-batch each) and on one process (2): same losses."
    from test_distributed import assert_close
    one, two = fsdp2_runs[name]
    assert_close(one, two, range(1, 5))
    assert len(set(one.values())) == 4 and all(abs(v) > 1e-3 for v in one.values()), one   # losses that say something
    if name == "rl": assert all(v < 0 for v in one.values()), one    # every group's longer rows earn more


def test_plan_plans_the_folders_model(inputs):
    r = run_gg("plan", "--recipe", ROOT/"recipes"/"instruct"/"debug.yaml", "--hf-checkpoint", inputs["folder"],
               "--gpu", "cpu", check=False)
    model, _ = load_hf(inputs["folder"])
    n = sum(p.numel() for p in model.parameters())
    assert f"{n:,}" in r.stdout or f"{n}" in r.stdout, r.stdout[-2000:]


@pytest.mark.slow   # about 65 s: an SFT run and an RL run through the CLI
def test_qwen3_recipes_run_sft_then_rl_on_a_local_folder_of_the_same_format(tmp_path):
    """The hub recipes (`recipes/instruct/qwen3-0.6b-smoltalk.yaml`, then `recipes/rl/qwen3-0.6b-gsm8k.yaml`) on a
    local Qwen3 folder with a ChatML tokenizer and template: SFT trains on its template's assistant turns, the RL
    recipe plans from the SFT run's model; sizes cut to seconds on CPU."""
    from test_tokenizer import _chatml_folder
    folder = _chatml_folder(tmp_path/"Qwen3-local")
    tok = init_tokenizer(TokenizerConfig(path=str(folder)))
    cfg = transformers.Qwen3Config(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=160,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=512, tie_word_embeddings=True)   # room for ChatML prompts
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    g = GlobalConfig(tokenizer=TokenizerConfig(path=str(folder)))
    prepare_instruct({"sources": [{"type": "verifiable", "train": 64, "val": 8, "seed": 0}]}, g,
                     tmp_path/"datasets"/"instruct", tok, progress=False)
    sets = _cli_sets({"datasets": tmp_path/"datasets"}, tmp_path/"runs", **{
        "training.max_steps": 2, "checkpointing.every": 2, "runtime.fsdp": "false", "runtime.compile": "false",
        "runtime.activation_checkpointing": "none"})
    run_gg("train", "--recipe", ROOT/"recipes"/"instruct"/"qwen3-0.6b-smoltalk.yaml", "--hf-checkpoint", folder,
           "--set", *sets)
    run = tmp_path/"runs"/"instruct"/"qwen3-0.6b-smoltalk"
    assert sorted(_losses(run)) == [1, 2]
    saved = load_checkpoint(run/"checkpoints"/"step_0000002.pt")
    assert saved["config"]["tokenizer"]["path"] == str(folder) and saved["config"]["model"]["qk_norm"]
    prepare_rl(None, g, tmp_path/"datasets"/"rl", tok)      # the verifiable tasks' prompts for a hub recipe's GSM8K
    rl_sets = [x for x in sets if not x.startswith(("training.max_steps", "training.seq_len", "training.total"))] + [
        "training.max_steps=1", "training.seq_len=256", "training.total_batch_size=2048", "rl.group_size=4",
        "rl.max_new_tokens=16", "rl.eval_k=1", "rl.mask_truncated=false"]   # a random model: every completion cut
    run_gg("train", "--recipe", ROOT/"recipes"/"rl"/"qwen3-0.6b-gsm8k.yaml", "--hf-checkpoint", folder,
           "--checkpoint", run/"checkpoints"/"step_0000002.pt", "--set", *rl_sets)
    rl = _records(tmp_path/"runs"/"rl"/"qwen3-0.6b-gsm8k")
    losses = [(r["step"], r["loss"]) for r in rl if "loss" in r]
    assert [s for s, _ in losses] == [1] and math.isfinite(losses[0][1])


QUIET = """import torch
from gradient_garden.checkpoint.hf import to_hf_model
from gradient_garden.config import ModelConfig
from gradient_garden.models.tendril import Tendril
to_hf_model(Tendril(ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=64, max_seq_len=16)))
from gradient_garden.models.float8 import torchao_float8
torchao_float8()
"""


def test_building_a_transformers_model_prints_no_torchao_notes():
    """`transformers` imports torchao when it builds a model (its quantizers); torchao's import notes (the pytree
    deprecation of its enums, its CUDA kernels on a machine without them) are dropped where we build one. Importing
    torchao bare shows what is dropped."""
    import subprocess, sys
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    start = lambda code: subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    bare, ours = start("import transformers, torchao"), start(QUIET)     # side by side
    (_, bare_err), (_, ours_err) = bare.communicate(timeout=300), ours.communicate(timeout=300)
    assert ours.returncode == 0 and ours_err == "", ours_err[-3000:]
    assert "is an Enum subclass" in bare_err or "torchao/_C" in bare_err, bare_err  # the notes it drops
