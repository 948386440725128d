"Every `gg` verb: its --help, and one real invocation each on a short run of the debug recipe."
import json
import pytest
from conftest import run_gg
from gradient_garden.cli import VERBS, main

RECIPE = "recipes/pretraining/debug.yaml"

@pytest.mark.parametrize("verb", sorted(VERBS))
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
           "training.total_batch_size=2048", "optimizers.adamw.warmup_steps=1", "validation.every=2",
           "validation.steps=1",
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

def test_generate_bf16_on_cpu_decodes_fp32_weights_under_autocast(checkpoint, tmp_path, monkeypatch):
    import torch
    import gradient_garden.cli.generate as cli_generate
    from gradient_garden.checkpoint.checkpoints import load_model_from_checkpoint
    from gradient_garden.batching import generate_text
    from gradient_garden.generation import PRETRAINING_TEST_PROMPTS
    from gradient_garden.tokenizer import init_tokenizer
    loaded = []
    def spy(path, device, dtype):
        loaded.append(dtype); return load_model_from_checkpoint(path, device, dtype)
    monkeypatch.setattr(cli_generate, "load_model_from_checkpoint", spy)
    out = tmp_path/"gen.json"
    assert main(["generate", "--checkpoint", str(checkpoint), "--max-gen-len", "6", "--device", "cpu", "--dtype",
                 "bf16",
                 "--output-file-name", str(out)]) == 0
    assert loaded == [torch.float32]                       # the weights stay fp32; the matmuls run in bf16
    model, cfg = load_model_from_checkpoint(checkpoint, torch.device("cpu"), torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = generate_text(model, init_tokenizer(cfg.tokenizer), PRETRAINING_TEST_PROMPTS, instruct=False,
                            max_new_tokens=6,
                            temperature=0.0, top_p=0.9, top_k=None, repetition_penalty=1.0, use_kv_cache=True,
                            batch_size=4, seed=42)
    assert [r["completion"] for r in json.loads(out.read_text())["results"]] == ref

@pytest.mark.parametrize("verb, modules", [("prepare", ["prepare"]), ("plan", ["train"]), ("generate", ["generate"]),
                                           ("evaluate", ["evaluate", "prepare"]), ("serve", ["serve"]),
                                           ("launch", ["launch"])])
def test_a_verb_imports_its_own_module_alone(verb, modules):
    "`gg VERB` starts fast: the verb table imports that verb's module (and what it imports), no other verb's."
    import subprocess, sys
    probe = (f"import sys; from gradient_garden.cli import build_parser; build_parser({verb!r}); "
             "print(' '.join(sorted(m for m in sys.modules if m.startswith('gradient_garden.cli.'))))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == sorted(["gradient_garden.cli.common"] + [f"gradient_garden.cli.{m}" for m in modules]), loaded
