"""Sharded checkpoints (torch.distributed.checkpoint) through the real trainer on gloo ranks: a run resumed on another
number of ranks (2->1, 1->2, 2->4, 4->2) takes the uninterrupted run's next losses (the global batch is the same on
every world size), on the same number exactly; an asynchronous save resumes like a synchronous one; a writer killed
in the middle of a sharded or an asynchronous save leaves the previous checkpoint the latest; and `gg generate` /
`gg export` read a sharded checkpoint in one process; an SFT run saved on 2 ranks resumes on 1."""
import json, os, subprocess, sys, textwrap
from pathlib import Path
import pytest
import torch
from conftest import ROOT, kill_once_partly_written, run_gg
from gradient_garden.config import ConfigError
from gradient_garden.checkpoint.checkpoints import CheckpointManager, list_checkpoints, load_checkpoint

from trainer_worlds import STEPS, all_runs, ckpts, losses

def assert_close(ref: dict, got: dict, steps, rel=1e-5):
    "Per-step losses agree within `rel` (relative) on `steps`."
    assert set(steps) <= set(got), sorted(got)
    worst = max(abs(ref[s] - got[s]) / abs(ref[s]) for s in steps)
    assert worst <= rel, [(s, ref[s], got[s]) for s in steps]

@pytest.fixture(scope="module")
def runs(prepared, tmp_path_factory):
    """`one` (1 process) and `two` (2 ranks, FSDP2, asynchronous saves) from scratch; resumed: `one_two` (1->2 from
    step 2), `two_four` (2->4 from step 4, saving at 6...), `four_two` (4->2 from step 6), `two_two` (2->2 from step 4)
    and `two_one` (2->1 from step 4). See `trainer_worlds.py`."""
    return all_runs(prepared, tmp_path_factory)

def test_every_world_size_resumes_with_the_same_losses(runs):
    one, two = losses(runs/"one"), losses(runs/"two")
    assert sorted(one) == sorted(two) == list(range(1, STEPS + 1))
    assert_close(one, two, range(1, STEPS + 1))             # 2 ranks (FSDP2) = 1 process, same global batch
    assert_close(one, losses(runs/"one_two"), range(3, STEPS + 1))   # 1 -> 2
    assert_close(two, losses(runs/"two_four"), range(5, STEPS + 1))  # 2 -> 4
    assert_close(two, losses(runs/"four_two"), range(7, STEPS + 1))  # 4 -> 2
    assert_close(two, losses(runs/"two_one"), range(5, STEPS + 1))   # 2 -> 1
    same = losses(runs/"two_two")                                    # 2 -> 2: bit for bit
    assert sorted(same) == list(range(5, STEPS + 1)) and all(same[s] == two[s] for s in same), (same, two)

def test_sft_resumes_on_another_number_of_ranks(runs):
    "An SFT run saved on 2 ranks continues on 1 process with the uninterrupted run's losses (the loaders' stream)."
    one, two, resumed = (losses(runs/n, "instruct") for n in ("one_sft", "two_sft", "two_one_sft"))
    assert_close(one, two, range(1, 5))                      # packed SFT on 2 ranks = 1 process, same global batch
    meta = load_checkpoint(ckpts(runs/"two_sft", "instruct")/"step_0000002", weights=False)
    assert meta["world_size"] == 2 and {l["world_size"] for l in meta["loaders"]} == {2}
    assert sorted(resumed) == [3, 4]
    assert_close(two, resumed, [3, 4])                       # 2 -> 1, no --reset-loader

def test_sharded_layout_and_meta(runs):
    d = ckpts(runs/"two")
    assert [p.name for p in list_checkpoints(d)] == [f"step_{s:07d}" for s in range(2, STEPS + 1, 2)]
    assert not [p for p in d.iterdir() if p.name.startswith(".")], "no temporary directory left behind"
    step4 = d/"step_0000004"
    assert sorted(p.name for p in step4.iterdir()) == [".metadata", "COMPLETE", "__0_0.distcp", "__1_0.distcp",
                                                       "meta.pt"]
    meta = load_checkpoint(step4, weights=False)
    assert (meta["step"], meta["world_size"], len(meta["loaders"]), len(meta["rngs"])) == (4, 2, 2, 2)
    assert meta["val_history"] and meta["val_history"][0][0] == 4 and meta["val_loss"] == meta["val_history"][0][1]
    # the shards hold no rank's full copy: each file is about half of the state
    sizes = [(step4/f"__{r}_0.distcp").stat().st_size for r in (0, 1)]
    assert max(sizes) < 0.7 * sum(sizes), sizes
    # one process, no process group: full tensors of the model and the optimizer
    full = load_checkpoint(step4)
    assert full["model"]["tok_embeddings.weight"].shape == (4096, 64)
    assert full["optimizers"]["state"]["tok_embeddings.weight"]["exp_avg"].shape == (4096, 64)
    four = load_checkpoint(ckpts(runs/"two_four")/"step_0000006", weights=False)
    assert (four["world_size"], len(four["loaders"])) == (4, 4)

def test_generate_evaluate_and_export_read_a_sharded_checkpoint(runs, tmp_path):
    ck = ckpts(runs/"two")/f"step_{STEPS:07d}"
    (tmp_path/"prompts.json").write_text(json.dumps(["def f(x):"]))
    r = run_gg("generate", "--checkpoint", ck, "--prompts", tmp_path/"prompts.json", "--max-gen-len", "4", "--device",
               "cpu",
               env={"WORLD_SIZE": None, "RANK": None})
    assert r.stdout.count("=== ") >= 1, r.stdout
    run_gg("export", "--checkpoint", ck, "--out", tmp_path/"hf")
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tmp_path/"hf")
    full = load_checkpoint(ck, optimizers=False)["model"]
    torch.testing.assert_close(hf.model.embed_tokens.weight, full["tok_embeddings.weight"])
    # a run dir:
    r = run_gg("evaluate", "--checkpoint", ckpts(runs/"two").parent, "--validation", "--validation-steps", "1",
               "--device", "cpu", "--output-file-name", tmp_path/"res.json", env={"WORLD_SIZE": None, "RANK": None})
    val = json.loads((tmp_path/"res.json").read_text())["validation"]
    assert val["tokens"] == 256 and val["loss"] < 8.0, val  # the trained weights: a fresh model scores ~ln(4096) = 8.3

WRITER = textwrap.dedent("""
    import sys, time, torch
    from gradient_garden.checkpoint.checkpoints import CheckpointManager
    mode, d, big = sys.argv[1], sys.argv[2], int(sys.argv[3])
    mgr = CheckpointManager(d, keep_last=3, keep_best=False, async_save=mode == "async")
    meta = dict(stage="pretraining", architecture="tendril", config={})
    mgr.save_sharded(1, {"model": {"w": torch.full((1000,), 1.0)}}, meta); mgr.wait()
    print("saved 1", flush=True)
    mgr.save_sharded(2, {"model": {"w": torch.rand(big), "v": torch.rand(big)}}, meta)
    print("returned 2", flush=True)
    while True: time.sleep(0.01)  # "training" on while the background write runs (async), or never reached (sync)
""")

@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_during_sharded_save_keeps_previous_checkpoint(tmp_path, mode):
    d, big = tmp_path/"checkpoints", 25_000_000  # 2 x 100 MB of shards: about a second or more to write here
    proc = subprocess.Popen([sys.executable, "-c", WRITER, mode, str(d), str(big)], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    tmp = d/".step_0000002.tmp"
    assert proc.stdout.readline().strip() == "saved 1"
    kill_once_partly_written(proc, lambda: list(tmp.glob("*.distcp")) if tmp.is_dir() else [])  # shards partly on disk
    assert not (d/"step_0000002").exists(), "the interrupted checkpoint must never appear under its final name"
    assert tmp.is_dir() and not (tmp/"COMPLETE").exists() and (tmp/"__0_0.distcp").stat().st_size < 8 * big
    assert [p.name for p in list_checkpoints(d)] == ["step_0000001"]
    ck = load_checkpoint(tmp_path)  # the run dir resolves to the previous checkpoint, and it loads
    assert ck["step"] == 1 and torch.equal(ck["model"]["w"], torch.full((1000,), 1.0))
    with pytest.raises(ConfigError, match="incomplete sharded checkpoint"): load_checkpoint(tmp)
    mgr = CheckpointManager(d, keep_last=3, keep_best=False)  # the next save clears the debris
    mgr.save_sharded(3, {"model": {"w": torch.ones(3)}}, dict(stage="pretraining", architecture="tendril", config={}))
    assert sorted(p.name for p in d.iterdir()) == ["step_0000001", "step_0000003"]

from test_post_training import _losses, _run_cfg, data, tok, tok_dir  # noqa: F401  (the post-training data fixtures)

@pytest.mark.parametrize("stage,over", [("instruct", {}), ("dpo", {})])
def test_sharded_resume_is_exact_for_sft_and_dpo(data, tmp_path, stage, over):
    "SFT and DPO (precomputed reference in the loader state) resume from an asynchronous sharded save bit for bit."
    from gradient_garden.train.run import run_training
    sharded = {"checkpointing": {"every": 2, "keep_last": 5, "format": "sharded", "async_save": True}}
    full = _run_cfg(data, stage, tmp_path/"full", **over, **sharded)
    run_training(full)
    resumed = _run_cfg(data, stage, tmp_path/"resumed", **over, **sharded)
    run_training(resumed, checkpoint=full.run_dir/"checkpoints"/"step_0000002")
    (a, va), (b, vb) = _losses(full.run_dir), _losses(resumed.run_dir)
    assert sorted(b) == [3, 4] and all(a[s] == b[s] for s in b), (a, b)
    assert va[4] == vb[4]

def test_sharded_resume_is_exact_for_moe(prepared, tmp_path):
    from trainer_worlds import MOE, sets, train
    train(sets(prepared, tmp_path/"full", **MOE))
    train(sets(prepared, tmp_path/"resumed", **MOE), ckpts(tmp_path/"full")/"step_0000002")
    a, b = losses(tmp_path/"full"), losses(tmp_path/"resumed")
    assert sorted(b) == [3, 4] and all(a[s] == b[s] for s in b), (a, b)

# -- a damaged shard file: the same "corrupted" line from every verb that loads the checkpoint ----------------------
RECIPE = "recipes/pretraining/debug.yaml"

def small_sets(prepared, out: Path, steps=2) -> list[str]:
    "A two-step, one-process run saving sharded checkpoints under `out`."
    s = {"paths.runs": out/"runs", "training.max_steps": steps, "training.log_every": 1, "model.dim": 64,
         "model.n_layers": 2,
         "model.n_heads": 4, "model.n_kv_heads": 2, "model.max_seq_len": 64, "training.seq_len": 64,
         "training.micro_batch_size": 4, "training.total_batch_size": 256, "validation.enabled": False,
         "generation.every": 0, "evals.every": 0, "checkpointing.every": steps, "checkpointing.format": "sharded",
         "optimizers.adamw.warmup_steps": 1, "runtime.device": "cpu"}
    return prepared["sets"] + [f"{k}={v}" for k, v in s.items()]

@pytest.fixture(scope="module")
def sharded_run(prepared, tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded_run")
    run_gg("train", "--recipe", RECIPE, "--set", *small_sets(prepared, out))
    return out

@pytest.mark.parametrize("damage", ["truncated", "deleted"])
def test_a_damaged_shard_is_corrupted_in_every_verb(prepared, sharded_run, tmp_path, damage, capsys):
    import shutil
    from gradient_garden.cli import main as gg
    shutil.copytree(sharded_run/"runs", tmp_path/"runs")
    run = tmp_path/"runs"/"pretraining"/"debug"
    ck, shard = run/"checkpoints"/"step_0000002", run/"checkpoints"/"step_0000002"/"__0_0.distcp"
    size = shard.stat().st_size
    if damage == "truncated": shard.write_bytes(shard.read_bytes()[: size // 3])
    else: shard.unlink()
    (tmp_path/"prompts.json").write_text(json.dumps(["def f(x):"]))
    verbs = {"train": ["train", "--recipe", RECIPE, "--checkpoint", ck, "--set",
                       *small_sets(prepared, tmp_path, steps=4)],
             "generate": ["generate", "--checkpoint", ck, "--prompts", tmp_path/"prompts.json", "--max-gen-len", "2",
                          "--device", "cpu"],
             "evaluate": ["evaluate", "--checkpoint", ck, "--validation", "--validation-steps", "1", "--device", "cpu"],
             "export": ["export", "--checkpoint", ck, "--out", tmp_path/"hf"]}
    said = {}
    for verb, argv in verbs.items():
        assert gg([str(a) for a in argv]) == 2, verb
        said[verb] = capsys.readouterr().err.strip().splitlines()[-1]
    what = f"is truncated: {size // 3:,} of {size:,} bytes" if damage == "truncated" else "is missing"
    assert set(said.values()) == {f"error: {ck}: corrupted sharded checkpoint (shard file __0_0.distcp {what}); use an "
                                  "earlier checkpoint"}, said
    assert not (tmp_path/"hf").exists()
    assert json.loads((run/"metrics.jsonl").read_text().splitlines()[-1])["step"] == 2   # the run directory untouched
    # `gg serve` loads through the same function as generate and evaluate
    from gradient_garden.checkpoint.checkpoints import load_model_from_checkpoint
    with pytest.raises(ConfigError) as e: load_model_from_checkpoint(ck)
    assert f"error: {e.value}" == said["generate"]
