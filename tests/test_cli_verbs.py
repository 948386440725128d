"Every `gg` verb: its --help, and one real invocation each on a short run of the debug recipe."
import json
from pathlib import Path
import pytest
from conftest import run_gg
from gradient_garden.cli import _verbs, main

RECIPE = "recipes/pretraining/debug.yaml"

@pytest.mark.parametrize("verb", sorted(_verbs()))
def test_every_verb_has_help(verb, capsys):
    with pytest.raises(SystemExit) as e: main([verb, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: gg {verb}") and "--" in out

@pytest.fixture(scope="module")
def checkpoint(prepared, tmp_path_factory):
    "A two-step pretraining run of the debug recipe and its last checkpoint."
    runs = tmp_path_factory.mktemp("verbs")
    run_gg("train", "--recipe", RECIPE, "--set", *prepared["sets"], f"paths.runs={runs}", "training.max_steps=2",
           "training.total_batch_size=2048", "optimizers.adamw.warmup_steps=1", "validation.every=2", "validation.steps=1",
           "checkpointing.every=2", "generation.every=0")
    (ckpt,) = sorted((runs/"pretraining"/"debug"/"checkpoints").glob("step_*"))
    return ckpt

def test_generate_without_prompts_uses_the_stage_defaults(checkpoint, tmp_path):
    out = tmp_path/"gen.json"
    run_gg("generate", "--checkpoint", checkpoint, "--max-gen-len", "4", "--device", "cpu", "--output-file-name", out)
    results = json.loads(out.read_text())["results"]
    from gradient_garden.generation import PRETRAINING_TEST_PROMPTS
    assert [r["prompt"] for r in results] == PRETRAINING_TEST_PROMPTS
    assert all(isinstance(r["completion"], str) for r in results)

def test_evaluate_and_export_run(checkpoint, prepared, tmp_path):
    res = tmp_path/"results.json"
    run_gg("evaluate", "--checkpoint", checkpoint, "--validation", "--validation-steps", "1", "--device", "cpu",
           "--output-file-name", res)
    assert "validation" in json.loads(res.read_text())
    run_gg("export", "--checkpoint", checkpoint, "--out", tmp_path/"hf")
    assert (tmp_path/"hf"/"config.json").is_file() and any((tmp_path/"hf").glob("*.safetensors"))
