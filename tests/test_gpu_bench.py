"""`bench/gpu.sh --smoke`: the script a lent GPU runs, run whole on the CPU (tiny shapes, gloo, no install), so that it
cannot rot between GPU sessions: one JSON line, every leg present and none failed, MFU computed for every leg."""
import json, os, subprocess, sys
from conftest import ROOT

LEGS = ["peak", "train_124m", "train_400m", "fsdp2_124m", "gg_train_124m", "decode", "attention", "rl_124m"]

def test_gpu_bench_smoke_has_every_leg():
    r = subprocess.run(["bash", "bench/gpu.sh", "--smoke"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable})
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1, r.stdout[-3000:]
    res = json.loads(lines[0])
    assert res["smoke"] is True and set(LEGS) <= set(res), sorted(res)
    failed = {leg: res[leg] for leg in LEGS if "error" in res[leg]}
    assert not failed, failed
    assert res["peak"]["measured_peak_flops"] > 0
    for leg in LEGS[1:]:   # the same formula for every leg: tokens/s x FLOPs/token / (measured peak x ranks)
        got = res[leg]
        assert got["tokens_per_s"] > 0 and got["mfu_measured_peak"] is not None and got["mfu_datasheet"] is None, (leg,
                                                                                                                   got)
    assert res["fsdp2_124m"]["fsdp2"] and res["fsdp2_124m"]["backend"] == "gloo" and res["fsdp2_124m"]["ranks"] == 2
    g = res["gg_train_124m"]
    assert g["checkpoint"] and g["val_loss"] is not None and g["steps"] == 6, g
    r = res["rl_124m"]   # the rl stage's own loader and loss: rollouts and the update both timed
    assert r["completions_per_s"] > 0 and 0 < r["rollout_share"] < 1 and r["rollout_tokens_per_s"] > 0, r
