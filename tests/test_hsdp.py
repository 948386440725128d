"""HSDP on 4 gloo ranks as a 2 x 2 mesh (replicate x shard), through the real trainer: the parameters are DTensors on a
2-D mesh, sharded over `shard` and replicated over `replicate`; per-step losses of 10 steps equal one process with the
same global batch within 1e-5 relative with AdamW and with Muon; MoE and LoRA train on it, and so do DPO (precomputed
reference) and distillation (teacher); evals and samples run on
it; and a 2 x 2 sharded checkpoint resumes on 2 x 2 (bit for bit) and on 1 rank. The runs are shared with
`test_sharded_checkpoints.py` (`trainer_worlds.py`: one 4-rank world holds all of them)."""
import json
import pytest
from trainer_worlds import STEPS, all_runs, ckpts, losses, run_dir
from gradient_garden.checkpoint.checkpoints import load_checkpoint

@pytest.fixture(scope="module")
def runs(prepared, tmp_path_factory): return all_runs(prepared, tmp_path_factory)

def assert_close(ref: dict, got: dict, steps, rel=1e-5):
    "Per-step losses agree within `rel` (relative) on `steps`; returns the worst relative difference."
    assert set(steps) <= set(ref) and set(steps) <= set(got), (sorted(ref), sorted(got))
    worst = max(abs(ref[s] - got[s]) / abs(ref[s]) for s in steps)
    assert worst <= rel, [(s, ref[s], got[s]) for s in steps]
    return worst

def test_the_mesh_is_two_by_two(runs):
    mesh = json.loads((runs/"mesh.json").read_text())
    assert mesh["shape"] == [2, 2] and mesh["names"] == ["replicate", "shard"]
    assert mesh["placements"] == ["R", "S(0)"] and mesh["local"] == [64, 64]  # wqkv: (64 + 2 x 32) x 64 in halves

@pytest.mark.parametrize("one, hsdp", [("one", "hsdp"), ("one_muon", "hsdp_muon")], ids=["adamw", "muon"])
def test_hsdp_matches_one_process(runs, one, hsdp):
    assert_close(losses(runs/one), losses(runs/hsdp), range(1, STEPS + 1))

def test_moe_and_lora_on_the_mesh(runs):
    for name in ("moe", "lora"): assert_close(losses(runs/f"one_{name}"), losses(runs/f"hsdp_{name}"), range(1, 5))

@pytest.mark.parametrize("name, stage", [("dpo", "dpo"), ("distill", "instruct")])
def test_dpo_and_distillation_on_the_mesh(runs, name, stage):
    "DPO (its reference log-probs computed on the mesh) and distillation (a frozen teacher on every rank), 4 steps."
    one, hsdp = losses(runs/f"one_{name}", stage), losses(runs/f"hsdp_{name}", stage)
    assert sorted(hsdp) == [1, 2, 3, 4]
    assert_close(one, hsdp, range(1, 5))

def test_evals_and_samples_on_the_mesh(runs):
    d = run_dir(runs/"hsdp")
    assert len((d/"samples.jsonl").read_text().splitlines()) == 2 * 4, "samples at steps 5 and 10, written by rank 0"
    recs = [json.loads(l) for l in (d/"metrics.jsonl").read_text().splitlines()]
    assert sum("hellaswag/acc" in r for r in recs) == 2

def test_hsdp_checkpoint_resumes_on_two_by_two_and_on_one_rank(runs):
    meta = load_checkpoint(ckpts(runs/"hsdp")/"step_0000004", weights=False)
    assert (meta["world_size"], meta["config"]["runtime"]["replicate"], meta["config"]["runtime"]["shard"]) == (4, 2, 2)
    full, same = losses(runs/"hsdp"), losses(runs/"hsdp_hsdp")
    assert sorted(same) == list(range(5, STEPS + 1)) and all(same[s] == full[s] for s in same), (same, full)
    assert_close(full, losses(runs/"hsdp_one"), range(5, STEPS + 1))
