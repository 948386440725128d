"""`gg train`'s run with expert parallelism (`runtime.expert_parallel`, FSDP2 for the other parameters): a TendrilMoE
on 2 gloo ranks gives one process's training losses and clipped gradient norms within 1e-5 (fp32, the same global
batch), and FSDP2's without expert parallelism; its sharded checkpoint resumes in one process, continuing one
process's losses. With DeepSeek-V3's bias balancing (`model.expert_bias_rate`) the expert-parallel run moves the same
biases as the FSDP2 run (loads summed over the ranks), and the biases change its losses. Marked slow: six runs, about
160 s on a loaded 2-core machine (42 s of CPU)."""
import json
import pytest
from gloo_ranks import run_ranks
from trainer_worlds import MOE, ckpts, losses, run_dir, sets, train

pytestmark = pytest.mark.slow
STEPS = 4
EP = {"runtime.fsdp": "true", "runtime.expert_parallel": "true"}
BIAS = {"model.expert_bias_rate": 0.1, "checkpointing.every": 0}

def _world(rank, world, jobs):
    "Rank body: each `(overrides, checkpoint)` run in turn."
    for overrides, checkpoint in jobs: train(overrides, checkpoint, world)

@pytest.fixture(scope="module")
def runs(prepared, tmp_path_factory):
    base = tmp_path_factory.mktemp("ep_train")
    S = lambda name, **kw: sets(prepared, base/name, **{**MOE, "training.max_steps": STEPS, "validation.every": 2,
                                                         "training.grad_clip": 0.5, **kw})
    train(S("one", **{"checkpointing.every": 0}))                       # one process: the reference
    run_ranks(_world, 2, base/"init2", [(S("ep", **EP), None),
                                        (S("fsdp", **{"runtime.fsdp": "true", "checkpointing.every": 0}), None),
                                        (S("ep_bias", **EP, **BIAS), None),
                                        (S("fsdp_bias", **{"runtime.fsdp": "true"}, **BIAS), None)])
    train(S("ep_one", **{"runtime.expert_parallel": "true"}), ckpts(base/"ep")/f"step_{2:07d}")   # EP -> one process
    return base

def assert_close(ref: dict, got: dict, steps, rel=1e-5):
    for s in steps: assert got[s] == pytest.approx(ref[s], rel=rel), (s, ref[s], got[s])

def grad_norms(out) -> dict:
    "step -> gradient norm (before clipping) of the run under `out`."
    recs = [json.loads(l) for l in (run_dir(out)/"metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["grad_norm"] for r in recs if "grad_norm" in r}

@pytest.mark.parametrize("name", ["ep", "fsdp"])
def test_ep_matches_one_process(runs, name):
    assert_close(losses(runs/"one"), losses(runs/name), range(1, STEPS + 1))
    norms = grad_norms(runs/"one")
    assert min(norms.values()) > 0.5                                      # grad_clip 0.5 clips every step
    assert_close(norms, grad_norms(runs/name), range(1, STEPS + 1))

def test_ep_checkpoint_resumes_in_one_process(runs):
    got = losses(runs/"ep_one")
    assert sorted(got) == [3, 4]                                          # resumed after step 2
    assert_close(losses(runs/"one"), got, [3, 4])

def test_ep_bias_balancing_matches_fsdp(runs):
    got, ref, plain = losses(runs/"ep_bias"), losses(runs/"fsdp_bias"), losses(runs/"ep")
    assert_close(ref, got, range(1, STEPS + 1))
    assert got[1] == pytest.approx(plain[1], rel=1e-5)                    # step 1 routes with a zero bias
    assert abs(got[STEPS] - plain[STEPS]) > 1e-4                          # the biases moved the routing
