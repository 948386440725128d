"Checkpoint faults a notebook cannot stage: a writer killed mid-save, damaged files, and the real model builder."
import copy, os, subprocess, sys, textwrap
from pathlib import Path
import pytest
import torch
from conftest import kill_once_partly_written

from gradient_garden.config import ConfigError, GlobalConfig, ModelConfig
from gradient_garden.checkpoint.checkpoints import (CheckpointManager, list_checkpoints, load_checkpoint,
                                                load_model_from_checkpoint, rng_state, save_checkpoint, set_rng_state)

BIG = 25_000_000  # float32 elements: a 100 MB checkpoint, about a second to write on these machines

WRITER = textwrap.dedent(f"""
    import sys, torch
    from gradient_garden.checkpoint.checkpoints import CheckpointManager
    mgr = CheckpointManager(sys.argv[1], keep_last=2, keep_best=False)
    def state(step, n):
        return dict(step=step, stage="pretraining", architecture="tendril", config={{}},
                    model={{"w": torch.full((n,), float(step))}})
    mgr.save(1, state(1, 1000))
    print("saved 1", flush=True)
    mgr.save(2, state(2, {BIG}))
    print("saved 2", flush=True)
""")


def _tmp_files(d: Path): return [p for p in d.iterdir() if p.name.startswith(".step_0000002.pt.tmp.")]


def test_kill_during_write_keeps_previous_checkpoint(tmp_path):
    d = tmp_path / "checkpoints"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(d)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).parents[1])
    assert proc.stdout.readline().strip() == "saved 1"
    size = kill_once_partly_written(proc, lambda: _tmp_files(d), timeout=60)  # the second checkpoint is partly on disk
    assert not (d / "step_0000002.pt").exists(), "the interrupted checkpoint must never appear under its final name"
    left = _tmp_files(d)
    assert left and left[0].stat().st_size < 4 * BIG, f"killed after the write finished (tmp {size} bytes)"
    # the previous checkpoint is what every lookup finds, and it loads
    assert [p.name for p in list_checkpoints(d)] == ["step_0000001.pt"]
    mgr = CheckpointManager(d, keep_last=2)
    assert mgr.latest().name == "step_0000001.pt"
    ck = load_checkpoint(tmp_path)  # a run dir resolves to checkpoints/ and its latest file
    assert ck["step"] == 1 and torch.equal(ck["model"]["w"], torch.full((1000,), 1.0))
    # the partial file is garbage to the loader, and the next save cleans it up
    with pytest.raises(ConfigError, match="corrupted or truncated"): load_checkpoint(left[0])
    mgr.save(3, dict(ck, step=3))
    assert not _tmp_files(d) and [p.name for p in list_checkpoints(d)] == ["step_0000001.pt", "step_0000003.pt"]


def _state(step=5):
    cfg = GlobalConfig()
    return dict(step=step, stage="pretraining", architecture="tendril", config=cfg.to_dict(),
                model={"w": torch.arange(4096.0)}, optimizers=[], loader={"pos": 3}, rng=rng_state(),
                val_history=[{"step": step, "val_loss": 2.5}], best_val_loss=2.5, tokenizer_identity="t")


@pytest.mark.parametrize("damage", ["empty", "truncate_1", "truncate_half", "truncate_tail", "bitflip", "text"])
def test_damaged_files_give_clear_errors(tmp_path, damage):
    p = save_checkpoint(_state(), tmp_path / "step_0000005.pt")
    raw = p.read_bytes()
    if damage == "empty": data = b""
    elif damage == "truncate_1": data = raw[:-1]
    elif damage == "truncate_half": data = raw[: len(raw) // 2]
    elif damage == "truncate_tail": data = raw[: len(raw) - 200]
    elif damage == "bitflip":
        data = bytearray(raw); data[len(raw) // 3] ^= 0x10
    else: data = b"step: 5\nmodel: weights\n"
    p.write_bytes(bytes(data))
    with pytest.raises(ConfigError) as e: load_checkpoint(p)
    msg = str(e.value)
    assert msg.startswith(str(p)) and "corrupted" in msg and "\n" not in msg, msg


def test_foreign_and_future_files(tmp_path):
    torch.save({"model": {"w": torch.ones(1)}}, tmp_path / "a.pt")
    with pytest.raises(ConfigError, match="not a Gradient Garden checkpoint"): load_checkpoint(tmp_path / "a.pt")
    p = save_checkpoint(_state(), tmp_path / "b.pt")
    ck = torch.load(p, weights_only=True)
    torch.save(dict(ck, version=99), tmp_path / "c.pt")
    with pytest.raises(ConfigError, match="format version 99"): load_checkpoint(tmp_path / "c.pt")
    torch.save({k: v for k, v in ck.items() if k != "model"}, tmp_path / "d.pt")
    with pytest.raises(ConfigError, match="incomplete checkpoint, missing model"): load_checkpoint(tmp_path / "d.pt")


def test_rng_round_trip_through_a_file(tmp_path):
    import random, numpy as np
    torch.manual_seed(3); random.seed(3); np.random.seed(3)
    p = save_checkpoint(_state(), tmp_path / "step_0000005.pt")
    expected = (random.random(), np.random.rand(2).tolist(), torch.randn(2).tolist())
    set_rng_state(load_checkpoint(p)["rng"])
    assert (random.random(), np.random.rand(2).tolist(), torch.randn(2).tolist()) == expected


def test_load_model_from_checkpoint_with_real_builder(tmp_path):
    registry = pytest.importorskip("gradient_garden.models.registry")
    cfg = GlobalConfig()
    cfg.model = ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=64, max_seq_len=16)
    torch.manual_seed(0)
    model = registry.build_model(cfg.model).eval()
    p = save_checkpoint(dict(_state(), config=cfg.to_dict(), architecture=cfg.model.architecture,
                             model=model.state_dict()), tmp_path / "step_0000005.pt")
    loaded, lcfg = load_model_from_checkpoint(p)
    assert lcfg.model == cfg.model and not loaded.training
    x = torch.randint(0, 64, (2, 8))
    with torch.no_grad(): torch.testing.assert_close(loaded(x), model(x))
    bad = copy.deepcopy(cfg); bad.model.dim = 64
    torch.save(dict(torch.load(p, weights_only=True), config=bad.to_dict()), tmp_path / "wrong.pt")
    with pytest.raises(ConfigError, match="weights do not fit"): load_model_from_checkpoint(tmp_path / "wrong.pt")


# -- sharded checkpoint directories (torch.distributed.checkpoint) --------------------------------------------------
def _sharded(tmp_path, **meta_kw):
    from gradient_garden.checkpoint.checkpoints import save_sharded_checkpoint, sharded_state
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    meta = {k: v for k, v in _state().items() if k != "model"} | meta_kw
    return save_sharded_checkpoint(sharded_state(model), meta, tmp_path/"ckpts"/"step_0000005"), model


def test_sharded_directory_that_carries_code_is_refused_without_running_it(tmp_path):
    import pickle
    d, _ = _sharded(tmp_path)
    marker = tmp_path/"pwned"
    class Payload:
        def __reduce__(self): return (os.system, (f"touch {marker}",))
    (d/".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(ConfigError,
                       match="not a Gradient Garden checkpoint .*posix.system is not allowed"): load_checkpoint(d)
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["no_meta", "truncated_shard", "no_metadata", "foreign_meta"])
def test_damaged_sharded_directories_give_clear_errors(tmp_path, damage):
    d, _ = _sharded(tmp_path)
    if damage == "no_meta": (d/"meta.pt").unlink()
    elif damage == "truncated_shard": (d/"__0_0.distcp").write_bytes((d/"__0_0.distcp").read_bytes()[:64])
    elif damage == "no_metadata": (d/".metadata").unlink()
    else: torch.save({"weights": torch.ones(1)}, d/"meta.pt")
    with pytest.raises(ConfigError) as e: load_checkpoint(d)
    msg = str(e.value)
    assert msg.startswith(str(d)) and "\n" not in msg, msg
    assert {"no_meta": "without meta.pt", "truncated_shard": "corrupted sharded checkpoint",
            "no_metadata": "incomplete sharded checkpoint (no .metadata)",
            "foreign_meta": "not a Gradient Garden checkpoint"}[damage] in msg


def test_sharded_checkpoint_of_another_architecture_or_stage_is_refused(tmp_path):
    from gradient_garden.checkpoint.checkpoints import check_compatible
    d, model = _sharded(tmp_path)
    meta = load_checkpoint(tmp_path/"ckpts", weights=False)
    assert "model" not in meta and meta["sharded"] == str(d)
    cfg = GlobalConfig(); cfg.model.architecture = "tendril_moe"
    with pytest.raises(ConfigError, match="model.architecture: got 'tendril_moe'"): check_compatible(meta, cfg)
    cfg = GlobalConfig(); cfg.training.stage = "instruct"
    with pytest.raises(ConfigError, match="training.stage: got 'instruct'"): check_compatible(meta, cfg)
    torch.testing.assert_close(load_checkpoint(d)["model"]["weight"], model.weight.detach())


def test_a_shard_overwritten_in_place_is_corrupted_for_resume_and_load(tmp_path):
    "Bytes changed without changing the length (the file check passes): a resume and a full load both say 'corrupted'."
    from gradient_garden.checkpoint.checkpoints import load_sharded_state, save_sharded_checkpoint, sharded_state
    def stepped():
        torch.manual_seed(0)
        m = torch.nn.Linear(64, 64); opt = torch.optim.AdamW(m.parameters())
        m(torch.ones(1, 64)).sum().backward(); opt.step()
        return m, opt
    m, opt = stepped()
    meta = {k: v for k, v in _state().items() if k != "model"}
    d = save_sharded_checkpoint(sharded_state(m, [opt]), meta, tmp_path/"step_0000005")
    shard = d/"__0_0.distcp"
    data = bytearray(shard.read_bytes()); data[-50:-42] = bytes(b ^ 0xFF
                                                                for b in data[-50:-42]); shard.write_bytes(bytes(data))
    with pytest.raises(ConfigError) as full: load_checkpoint(d)
    with pytest.raises(ConfigError) as resume: load_sharded_state(d, *(lambda m, o: (m, [o]))(*stepped()))
    for e in (full,
              resume): assert str(e.value).startswith(f"{d}: corrupted sharded checkpoint (rank 0: "), str(e.value)
    assert str(full.value) == str(resume.value)
