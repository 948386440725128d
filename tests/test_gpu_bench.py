"""`bench/gpu.sh`: the script a lent GPU runs. `--smoke` runs it whole on the CPU (tiny shapes, gloo, no install), so
that it cannot rot between GPU sessions: one JSON line, every leg present and none failed, MFU computed for every
leg. The torch it would install is chosen from the driver version a stubbed `nvidia-smi` reports; `--legs` and the
deadline are respected; each leg's line is in legs.jsonl as soon as the leg ends, so a killed run keeps them."""
import json
import re, os, signal, subprocess, sys, time
import pytest
from conftest import ROOT

LEGS = ["peak", "train_124m", "train_400m", "float8_124m", "float8_400m", "collectives", "fsdp2_124m",
        "gg_train_124m", "decode", "attention", "rl_124m"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}


def gpu_sh(*args, timeout=600):
    return subprocess.run(["bash", "bench/gpu.sh", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=ENV)


def test_gpu_bench_smoke_has_every_leg(tmp_path):
    r = gpu_sh("--smoke", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1, r.stdout[-3000:]
    res = json.loads(lines[0])
    assert res["smoke"] is True and set(LEGS) <= set(res), sorted(res)
    failed = {leg: res[leg] for leg in LEGS if "error" in res[leg] or "skipped" in res[leg]}
    assert not failed, failed
    assert res["peak"]["measured_peak_flops"] > 0
    for leg in set(LEGS) - {"peak", "collectives"}:   # one formula: tokens/s x FLOPs/token / (measured peak x ranks)
        got = res[leg]
        assert got["tokens_per_s"] > 0 and got["mfu_measured_peak"] is not None and got["mfu_datasheet"] is None, (leg,
                                                                                                                   got)
    assert res["fsdp2_124m"]["fsdp2"] and res["fsdp2_124m"]["backend"] == "gloo" and res["fsdp2_124m"]["ranks"] == 2
    c = res["collectives"]   # two processes really exchanging tensors
    assert c["ranks"] == 2 and c["backend"] == "gloo" and c["one_float_all_reduce_us"] > 0, c
    assert all(row["bus_gb_s"] > 0 for row in c["all_reduce"]), c
    for size in ("124m", "400m"):   # the float8 legs: the Linear layers converted, a speed against bf16
        assert res[f"float8_{size}"]["float8"] == "tensorwise" and res[f"float8_{size}"]["speedup_vs_bf16"] > 0
    g = res["gg_train_124m"]
    assert g["checkpoint"] and g["val_loss"] is not None and g["steps"] == 6, g
    r = res["rl_124m"]   # the rl stage's own loader and loss: rollouts and the update both timed
    assert r["completions_per_s"] > 0 and 0 < r["rollout_share"] < 1 and r["rollout_tokens_per_s"] > 0, r
    rows = [json.loads(x) for x in (tmp_path/"legs.jsonl").read_text().splitlines()]   # one line per leg
    assert sorted(x["leg"] for x in rows) == sorted(LEGS), rows


# driver version nvidia-smi reports -> the wheel indexes tried in order, and a word the one-line reason must hold
DRIVERS = {
    "535.104.05": ("cu129,cu128,cu126", "only by minor-version compatibility"),   # CUDA 12.2's driver
    "550.54.15": ("cu129,cu128,cu126", "only by minor-version compatibility"),    # CUDA 12.4's
    "560.35.03": ("cu129,cu128,cu126", "12.6 natively"),
    "570.86.10": ("cu129,cu128,cu126", "12.8 natively"),
    "575.57.08": ("cu129,cu128,cu126", "12.9 natively"),
    "580.65.06": ("cu130,cu129", "CUDA 13"),
    "580.65": ("cu130,cu129", "CUDA 13"),
    "470.82.01": ("none:", "older than 525.60.13"),
    "garbage": ("none:", "no driver version"),
}


def choose(tmp_path, script: str | None) -> str:
    "What `gpu.sh --choose-torch` prints with PATH holding only a stub `nvidia-smi` running `script` (or nothing)."
    (tmp_path/"bin").mkdir(exist_ok=True)
    stub = tmp_path/"bin"/"nvidia-smi"
    if script is not None: stub.write_text("#!/bin/sh\n" + script); stub.chmod(0o755)
    r = subprocess.run(["/bin/bash", "bench/gpu.sh", "--choose-torch"], cwd=ROOT, capture_output=True, text=True,
                       timeout=30, env={"PATH": str(tmp_path/"bin")})
    assert r.returncode == 0 and len(r.stdout.strip().splitlines()) == 1, (r.stdout, r.stderr)
    return r.stdout.strip()


@pytest.mark.parametrize("version", list(DRIVERS))
def test_torch_chosen_from_driver(tmp_path, version):
    wheels, why = DRIVERS[version]
    got = choose(tmp_path, f'echo "{version}"\necho "{version}"\n')   # two GPUs: one line each
    assert got.split()[0] == wheels and why in got, got


def test_torch_chosen_without_a_driver(tmp_path):
    assert choose(tmp_path, None) == "none: no nvidia-smi on PATH, so no NVIDIA driver to run a CUDA torch"
    got = choose(tmp_path, "echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\"\n"
                           "exit 9\n")
    assert got.startswith("none: nvidia-smi failed: NVIDIA-SMI has failed"), got


def test_legs_and_deadline(tmp_path):
    r = gpu_sh("--smoke", "--legs", "decode", "--out", str(tmp_path/"one"))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["decode"]["tokens_per_s"] > 0, res["decode"]
    assert all(res[leg] == {"skipped": "not in --legs"} for leg in LEGS if leg != "decode"), res
    r = gpu_sh("--smoke", "--deadline", "0", "--legs", "peak,collectives", "--out", str(tmp_path/"late"))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for leg in ("peak", "collectives"):
        assert "before the deadline" in res[leg]["skipped"], res[leg]
    # the clock may tick between the two legs' checks, so the time left is 0 or less, never an exact figure
    assert re.search(r"skipped collectives: needs 1s, (0|-\d+)s left before the deadline", r.stderr), r.stderr
    assert gpu_sh("--smoke", "--legs", "nope").returncode == 2


def test_killed_run_keeps_finished_legs(tmp_path):
    out = tmp_path/"out"
    p = subprocess.Popen(["bash", "bench/gpu.sh", "--smoke", "--out", str(out)], cwd=ROOT, env=ENV,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        t0 = time.time()
        while not ((out/"legs.jsonl").exists() and (out/"legs.jsonl").read_text().strip()):
            assert p.poll() is None and time.time() - t0 < 120, "no leg finished"
            time.sleep(0.2)
    finally: os.killpg(p.pid, signal.SIGKILL); p.wait()
    rows = [json.loads(x) for x in (out/"legs.jsonl").read_text().splitlines()]
    assert rows[0]["leg"] == "peak" and rows[0]["measured_peak_flops"] > 0, rows
    assert json.loads((out/"peak.json").read_text())["measured_peak_flops"] > 0
    assert not (out/"summary.json").exists()   # killed before the end: the legs' lines are what is left
