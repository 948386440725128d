"""Preemption: SIGTERM / SIGUSR1 / Ctrl-C finish the step, write a checkpoint and exit with one line; the resumed run
reproduces the uninterrupted losses exactly (1 process, and 2 gloo ranks with the signal sent to one rank only); a
checkpoint write that fails ends with one line naming the cause and the last intact checkpoint."""
import json, os, signal, subprocess, sys, time
from pathlib import Path
import psutil
import pytest
from conftest import ROOT, GG, run_gg

RECIPE = "recipes/pretraining/debug.yaml"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "gradient_garden.cli"]
STEPS = 30

def sets(prepared, out: Path, **extra):
    "A small, fast run: 1024 tokens a step, a loss row every step, no periodic checkpoints, writing under `out`."
    s = {"paths.runs": out/"runs", "training.max_steps": STEPS, "training.log_every": 1, "model.dim": 64, "model.n_layers": 2,
         "model.n_heads": 4, "model.n_kv_heads": 2, "model.max_seq_len": 64, "training.seq_len": 64,
         "training.micro_batch_size": 4, "training.total_batch_size": 1024, "validation.enabled": False,
         "generation.every": 0, "checkpointing.every": 0, "optimizers.adamw.warmup_steps": 2, "runtime.device": "cpu", **extra}
    return prepared["sets"] + [f"{k}={v}" for k, v in s.items()]

def run_dir(out: Path) -> Path: return out/"runs"/"pretraining"/"debug"

def losses(out: Path) -> dict:
    "step -> loss; each step logged once."
    recs = [json.loads(l) for l in (run_dir(out)/"metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in recs]
    assert len(steps) == len(set(steps)), f"a step is logged twice: {steps}"
    return {r["step"]: r["loss"] for r in recs}

def wait_for_rows(out: Path, n: int, proc, timeout=300):
    "Block until the run has logged `n` steps (the signal handlers are installed by then)."
    t0, m = time.time(), run_dir(out)/"metrics.jsonl"
    while time.time() - t0 < timeout:
        if proc.poll() is not None: raise AssertionError(f"run ended early: {proc.communicate()}")
        if m.is_file() and len(m.read_text().splitlines()) >= n: return
        time.sleep(0.05)
    raise AssertionError("run did not start")

def signalled_then_resumed(prepared, out, start, pick_pid, sig, launcher):
    "Start a run, signal the process `pick_pid(proc)` after 3 steps, check the one line, resume in place; the losses."
    proc = subprocess.Popen(launcher + ["train", "--recipe", RECIPE, "--set", *sets(prepared, out)], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_rows(out, 3, proc)
    os.kill(pick_pid(proc), sig)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode != 0 and "Traceback" not in stderr.split("stopped by")[0], stderr[-3000:]
    line = next(l for l in stderr.splitlines() if l.startswith("stopped by"))
    step = int(line.split(" at step ")[1].split(":")[0])
    layout = ".pt" if launcher == GG else ""  # checkpointing.format: auto — one file on one process, shards on several
    assert line == (f"stopped by {signal.Signals(sig).name} at step {step}: checkpoint "
                    f"{run_dir(out)/'checkpoints'/f'step_{step:07d}{layout}'}; resume with --checkpoint {run_dir(out)}"), line
    assert 3 <= step < STEPS, step
    assert f"{start}: stopped by {signal.Signals(sig).name}" in stdout  # the summary table says so too
    r = subprocess.run(launcher + ["train", "--recipe", RECIPE, "--checkpoint", run_dir(out), "--set", *sets(prepared, out)],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return step, losses(out)

@pytest.fixture(scope="module")
def full(prepared, tmp_path_factory):
    "The uninterrupted run's losses."
    out = tmp_path_factory.mktemp("full")
    run_gg("train", "--recipe", RECIPE, "--set", *sets(prepared, out))
    return losses(out)

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_and_resume_is_exact(prepared, tmp_path, sig, full):
    step, resumed = signalled_then_resumed(prepared, tmp_path/"cut", "pretraining", lambda p: p.pid, sig, GG)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert resumed == full  # bit-exact, steps before and after the signal

def rank_pid(proc, rank: int) -> int:
    "The pid of torchrun worker `rank`."
    for _ in range(100):
        for c in psutil.Process(proc.pid).children(recursive=True):
            try:
                if c.environ().get("RANK") == str(rank) and "gradient_garden.cli" in " ".join(c.cmdline()): return c.pid
            except psutil.Error: pass
        time.sleep(0.1)
    raise AssertionError(f"no rank {rank} worker")

@pytest.mark.slow
def test_signal_to_one_rank_saves_on_all(prepared, tmp_path):
    "SIGUSR1 to rank 1 only: both ranks agree to stop at the same step; resumed on 2 ranks, the losses are exact."
    full = subprocess.run(TORCHRUN + ["train", "--recipe", RECIPE, "--set", *sets(prepared, tmp_path/"full")], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=600)
    assert full.returncode == 0, full.stderr[-3000:]
    step, resumed = signalled_then_resumed(prepared, tmp_path/"cut", "pretraining", lambda p: rank_pid(p, 1),
                                           signal.SIGUSR1, TORCHRUN)
    assert resumed == losses(tmp_path/"full")

FAIL_SECOND_SAVE = """
import errno, sys, unittest.mock as m
import gradient_garden.engine.checkpoints as ck
real, calls = ck.torch.save, []
def save(*a, **k):
    calls.append(1)
    if len(calls) > 1: raise OSError(errno.ENOSPC, "No space left on device")
    return real(*a, **k)
ck.torch.save = save
from gradient_garden.cli import main
sys.exit(main(sys.argv[1:]))
"""

def test_disk_full_during_a_checkpoint_is_one_line(prepared, tmp_path):
    r = subprocess.run([sys.executable, "-c", FAIL_SECOND_SAVE, "train", "--recipe", RECIPE, "--set",
                        *sets(prepared, tmp_path, **{"training.max_steps": 8, "checkpointing.every": 4})],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    ck = run_dir(tmp_path)/"checkpoints"
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (
        "error: checkpoint of step 8 not written: disk full (OSError: [Errno 28] No space left on device); "
        f"the last intact checkpoint is {ck/'step_0000004.pt'}")
    assert sorted(p.name for p in ck.iterdir()) == ["step_0000004.pt"]  # no temporary file left behind
