"What a new user hits, replayed: each case is one clear line (exit status 2) or the right result."
import json
from pathlib import Path
import pytest
import torch
from gradient_garden.cli import main as gg
from gradient_garden.cli.prepare import prepare_lock
from gradient_garden.config import GlobalConfig, ModelConfig, TokenizerConfig, to_plain
from gradient_garden.checkpoint.checkpoints import save_checkpoint
from gradient_garden.models.tendril import Tendril
from gradient_garden.tokenizer import train_bpe


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    "A tiny random model saved as a pretraining and as an instruct checkpoint (same weights)."
    d = tmp_path_factory.mktemp("user")
    cfg = GlobalConfig()
    cfg.model = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=640, multiple_of=32, max_seq_len=96,
                            init_std=0.1)
    cfg.tokenizer = TokenizerConfig(backend="huggingface",
                                    path=str(train_bpe([Path(json.__file__).read_text(),
                                                        Path(pytest.__file__).read_text()] * 20, 640, d/"tok")))
    torch.manual_seed(0)
    weights = Tendril(cfg.model).state_dict()
    out = {}
    for stage in ("pretraining", "instruct"):
        plain = to_plain(cfg); plain["training"]["stage"] = stage
        out[stage] = save_checkpoint(dict(step=1, stage=stage, architecture="tendril", config=plain, model=weights),
                                     d/stage/"checkpoints"/"step_0000001.pt")
    return d, out


def one_line_error(capsys, argv) -> str:
    assert gg(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def completions(path: Path) -> list[str]: return [r["completion"] for r in json.loads(path.read_text())["results"]]


def test_generate_uses_the_checkpoints_chat_format(checkpoints, capsys):
    "An instruct checkpoint without flags gives what --instruct gives; --raw completes the plain text."
    d, ck = checkpoints
    (d/"p.json").write_text(json.dumps(["What is 12 + 30?", {"messages": [{"role": "user", "content": "hi"}]},
                                        {"prompt": "Spell cat"}]))
    got = {}
    for flags in ([], ["--instruct"]):
        out = d/f"gen{len(flags)}.json"
        assert gg(["generate", "--checkpoint", str(ck["instruct"]), "--prompts", str(d/"p.json"), "--max-gen-len", "5",
                   "--device", "cpu", "--output-file-name", str(out), *flags]) == 0
        got[tuple(flags)] = completions(out)
    assert got[()] == got[("--instruct",)]
    assert "prompts: chat format (the checkpoint's stage is instruct; --raw for plain text)" in capsys.readouterr().out
    (d/"plain.json").write_text(json.dumps(["What is 12 + 30?"]))
    for ckpt, flags in ((ck["instruct"], ["--raw"]), (ck["pretraining"], [])):
        out = d/"raw.json"
        assert gg(["generate", "--checkpoint", str(ckpt), "--prompts", str(d/"plain.json"), "--max-gen-len", "5",
                   "--device", "cpu",
                   "--output-file-name", str(out), *flags]) == 0
        got[(ckpt.parent.parent.name, *flags)] = completions(out)
    # same weights: raw is raw whatever the stage
    assert got["instruct", "--raw"] == got[("pretraining",)] != got[()][:1]
    err = one_line_error(capsys,
                         ["generate", "--checkpoint", str(ck["instruct"]), "--prompts", str(d/"p.json"), "--raw",
                          "--device", "cpu"])
    assert "--prompts: item 1 is a chat (messages); plain-text completion (--raw) takes strings only" in err


def test_a_messages_string_is_an_error_not_a_prompt(checkpoints, capsys):
    d, ck = checkpoints
    (d/"bad.json").write_text(json.dumps([{"messages": "hi"}]))
    err = one_line_error(capsys,
                         ["generate", "--checkpoint", str(ck["instruct"]), "--prompts", str(d/"bad.json"), "--device",
                          "cpu"])
    assert "item 0: 'messages' must be a non-empty list of {role, content} objects (got str)" in err


def test_export_out_naming_a_file(checkpoints, capsys):
    d, ck = checkpoints
    (d/"a_file").write_text("x")
    err = one_line_error(capsys, ["export", "--checkpoint", str(ck["pretraining"]), "--out", str(d/"a_file")])
    assert f"--out: {d/'a_file'} is a file, not a folder" in err


def test_a_second_prepare_into_one_folder_is_refused(tmp_path, capsys):
    "While one gg prepare holds the datasets folder, another stops with one line; the lock goes with its holder."
    with prepare_lock(tmp_path/"data"):
        err = one_line_error(capsys, ["prepare", "--pretraining", "--set", f"paths.datasets={tmp_path/'data'}",
                                      f"tokenizer.path={tmp_path/'tok'}"])
    assert f"{tmp_path/'data'}: another gg prepare is writing here (pid " in err and not (tmp_path/"tok").exists()
    with prepare_lock(tmp_path/"data"): pass


def test_a_one_process_sharded_save_prints_no_warning(tmp_path):
    ("dcp's 'assuming the intent is to save in a single process' is what we mean on one process: not printed (sync or "
     "background).")
    import subprocess, sys
    code = """
import sys, torch
from pathlib import Path
from gradient_garden.checkpoint.checkpoints import CheckpointManager
meta = dict(stage="pretraining", architecture="tendril", config={})
for async_save in (False, True):
    m = CheckpointManager(Path(sys.argv[1])/str(async_save), keep_last=2, keep_best=False, async_save=async_save,
                          raise_failures=True)
    m.save_sharded(2, {"model": {"w": torch.ones(3)}}, meta); m.wait()
print("saved")
"""
    r = subprocess.run([sys.executable, "-W", "default", "-c", code, str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "saved", r.stderr[-2000:]
    assert "single process" not in r.stderr, r.stderr[-2000:]


# -- runs that say what happened: gg notebook shows gg train's console and its one-line errors -----------------------
RECIPE = "recipes/pretraining/debug.yaml"

def small_run(prepared, out: Path, steps=2) -> list[str]:
    "`--set` values of a two-step, one-process run under `out`."
    s = {"paths.runs": out/"runs", "training.max_steps": steps, "training.log_every": 1, "model.dim": 64,
         "model.n_layers": 2,
         "model.n_heads": 4, "model.n_kv_heads": 2, "model.max_seq_len": 64, "training.seq_len": 64,
         "training.micro_batch_size": 4, "training.total_batch_size": 256, "validation.every": steps,
         "validation.steps": 1,
         "generation.every": 0, "evals.every": 0, "checkpointing.every": steps, "optimizers.adamw.warmup_steps": 1,
         "runtime.device": "cpu"}
    return prepared["sets"] + [f"{k}={v}" for k, v in s.items()]


def test_gg_notebook_shows_the_console_of_gg_train(prepared, tmp_path):
    from conftest import run_gg
    r = run_gg("notebook", "--recipe", RECIPE, "--set", *small_run(prepared, tmp_path))
    assert "Unable to parse" not in r.stderr and "unknown parameter" not in r.stderr, r.stderr
    out = r.stdout.splitlines()
    assert [l.split(" |")[0] for l in out if l.startswith("pretraining ")] == ["pretraining 1/2 (50%)",
                                                                               "pretraining 2/2 (100%)"], r.stdout
    assert "pretraining: finished" in out and any(l.startswith("MFU ") for l in out), r.stdout      # the summary table
    assert sum(l.startswith("mfu: against a peak of ") for l in out) == 1, r.stdout
    report = tmp_path/"runs"/"pretraining"/"debug"/"report.ipynb"
    assert out[-1] == f"report: {report}" and report.is_file()
    # the report's own output stays in it
    assert not any("dense model" in l or l.startswith("rank 0 of") for l in out), r.stdout


def test_gg_notebook_says_the_kernels_error_as_gg_train_does(prepared, tmp_path):
    from conftest import run_gg
    bad = small_run(prepared, tmp_path) + [f"paths.datasets={tmp_path/'nowhere'}"]
    train = run_gg("train", "--recipe", RECIPE, "--set", *bad, check=False)
    nb = run_gg("notebook", "--recipe", RECIPE, "--set", *bad, "--overwrite", check=False)
    assert train.returncode == nb.returncode == 2, nb.stderr[-3000:]
    assert nb.stderr.strip().splitlines()[-1] == train.stderr.strip().splitlines()[-1], (nb.stderr[-2000:],
                                                                                         train.stderr[-500:])
    assert "nowhere" in nb.stderr.strip().splitlines()[-1]
    assert "Traceback" not in nb.stderr and "PapermillExecutionError" not in nb.stderr
    # the executed notebook, with the traceback
    assert (tmp_path/"runs"/"pretraining"/"debug"/"report.ipynb").is_file()


def test_gg_notebook_says_any_other_kernel_error_in_one_line(prepared, tmp_path):
    from conftest import run_gg
    from gradient_garden.cli.train import default_train_notebook
    nb = json.loads(default_train_notebook().read_text())
    params = next(c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", []))
    nb["cells"] = [params, {"cell_type": "code", "execution_count": None, "id": "boom", "metadata": {}, "outputs": [],
                            "source": "print('before')\n1 / 0"}]
    (tmp_path/"boom.ipynb").write_text(json.dumps(nb))
    r = run_gg("notebook", "--recipe", RECIPE, "--notebook", tmp_path/"boom.ipynb", "--output", tmp_path/"out.ipynb",
               "--set", *small_run(prepared, tmp_path), check=False)
    assert r.returncode == 1 and r.stdout.splitlines()[0] == "before", (r.stdout, r.stderr[-2000:])
    assert r.stderr.strip().splitlines() == ["error: ZeroDivisionError: division by zero (its traceback is in "
                                             f"{tmp_path/'out.ipynb'})"], r.stderr
