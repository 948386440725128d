"What a new user hits, replayed: each case is one clear line (exit status 2) or the right result."
import json
from pathlib import Path
import pytest
import torch
from gradient_garden.cli import main as gg
from gradient_garden.cli.prepare import prepare_lock
from gradient_garden.config import GlobalConfig, ModelConfig, TokenizerConfig, to_plain
from gradient_garden.engine.checkpoints import save_checkpoint
from gradient_garden.models.tendril import Tendril
from gradient_garden.tokenizer import train_bpe


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    "A tiny random model saved as a pretraining and as an instruct checkpoint (same weights)."
    d = tmp_path_factory.mktemp("user")
    cfg = GlobalConfig()
    cfg.model = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=640, multiple_of=32, max_seq_len=96, init_std=0.1)
    cfg.tokenizer = TokenizerConfig(backend="huggingface", path=str(train_bpe([Path(json.__file__).read_text(), Path(pytest.__file__).read_text()] * 20, 640, d/"tok")))
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
    (d/"p.json").write_text(json.dumps(["What is 12 + 30?", {"messages": [{"role": "user", "content": "hi"}]}, {"prompt": "Spell cat"}]))
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
        assert gg(["generate", "--checkpoint", str(ckpt), "--prompts", str(d/"plain.json"), "--max-gen-len", "5", "--device", "cpu",
                   "--output-file-name", str(out), *flags]) == 0
        got[ckpt.parent.parent.name, *flags] = completions(out)
    assert got["instruct", "--raw"] == got[("pretraining",)] != got[()][:1]   # same weights: raw is raw whatever the stage
    err = one_line_error(capsys, ["generate", "--checkpoint", str(ck["instruct"]), "--prompts", str(d/"p.json"), "--raw", "--device", "cpu"])
    assert "--prompts: item 1 is a chat (messages); plain-text completion (--raw) takes strings only" in err


def test_a_messages_string_is_an_error_not_a_prompt(checkpoints, capsys):
    d, ck = checkpoints
    (d/"bad.json").write_text(json.dumps([{"messages": "hi"}]))
    err = one_line_error(capsys, ["generate", "--checkpoint", str(ck["instruct"]), "--prompts", str(d/"bad.json"), "--device", "cpu"])
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
    "dcp's 'assuming the intent is to save in a single process' is what we mean on one process: not printed (sync or background)."
    import subprocess, sys
    code = """
import sys, torch
from pathlib import Path
from gradient_garden.engine.checkpoints import CheckpointManager
meta = dict(stage="pretraining", architecture="tendril", config={})
for async_save in (False, True):
    m = CheckpointManager(Path(sys.argv[1])/str(async_save), keep_last=2, keep_best=False, async_save=async_save, raise_failures=True)
    m.save_sharded(2, {"model": {"w": torch.ones(3)}}, meta); m.wait()
print("saved")
"""
    r = subprocess.run([sys.executable, "-W", "default", "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "saved", r.stderr[-2000:]
    assert "single process" not in r.stderr, r.stderr[-2000:]
