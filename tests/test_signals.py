"""Preemption: SIGTERM / SIGUSR1 / Ctrl-C finish the step, write a checkpoint and exit with one line (also through
`gg notebook`, whose kernel gets the signal passed on); the resumed run
reproduces the uninterrupted losses exactly (1 process, and 2 gloo ranks with the signal sent to one rank only, agreed
at the same step though the ranks agree only every few steps); a 2-rank DDP or FSDP2 checkpoint resumes bit for bit on
one process with `training.virtual_ranks=2`; a
checkpoint write that fails ends with one line naming the cause and the last intact checkpoint."""
import json, os, shutil, signal, subprocess, sys, time
from pathlib import Path
import psutil
import pytest
from conftest import ROOT, GG, run_gg

RECIPE = "recipes/pretraining/debug.yaml"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
            "gradient_garden.cli"]
STEPS = 30

def sets(prepared, out: Path, **extra):
    "A small, fast run: 1024 tokens a step, a loss row every step, no periodic checkpoints, writing under `out`."
    s = {"paths.runs": out/"runs", "training.max_steps": STEPS, "training.log_every": 1, "model.dim": 64,
         "model.n_layers": 2,
         "model.n_heads": 4, "model.n_kv_heads": 2, "model.max_seq_len": 64, "training.seq_len": 64,
         "training.micro_batch_size": 4, "training.total_batch_size": 1024, "validation.enabled": False,
         "generation.every": 0, "checkpointing.every": 0, "optimizers.adamw.warmup_steps": 2, "runtime.device": "cpu",
         "runtime.stop_check_s": 0.1, **extra}   # several ranks agree on a stop every 0.1 s of steps
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
                    f"{run_dir(out)/'checkpoints'/f'step_{step:07d}{layout}'}; "
                    f"resume with --checkpoint {run_dir(out)}"), line
    assert 3 <= step < STEPS, step
    assert f"{start}: stopped by {signal.Signals(sig).name}" in stdout  # the summary table says so too
    r = subprocess.run(launcher + ["train", "--recipe", RECIPE, "--checkpoint", run_dir(out), "--set",
                                   *sets(prepared, out)],
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

@pytest.mark.slow
@pytest.mark.parametrize("fsdp", ["false", "true"], ids=["ddp", "fsdp2"])
def test_a_two_rank_checkpoint_resumes_bit_exactly_on_one_process(prepared, tmp_path, fsdp):
    ("A 2-rank run's step-10 checkpoint (DDP, or FSDP2 reduce-scattering each of 2 micro-steps per rank), resumed on "
     "one process with training.virtual_ranks=2: every later loss equal.")
    every = {"checkpointing.every": 10, "checkpointing.keep_last": 5, "runtime.fsdp": fsdp}
    if fsdp == "true": every["runtime.precision"] = "fp32"   # FSDP2's bf16 weights are not autocast's: fp32 only
    r = subprocess.run(TORCHRUN + ["train", "--recipe", RECIPE, "--set", *sets(prepared, tmp_path/"two", **every)],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    two = losses(tmp_path/"two")
    for name, extra in (("exact", {"training.virtual_ranks": 2}), ("plain", {})):
        shutil.copytree(tmp_path/"two", tmp_path/name)
        ck = run_dir(tmp_path/name)/"checkpoints"/"step_0000010"
        r = run_gg("train", "--recipe", RECIPE, "--checkpoint", ck, "--set",
                   *sets(prepared, tmp_path/name, **every, **extra))
        if name == "plain": assert "saved by 2 ranks; one process adds their gradients in another order" in r.stderr
    exact, plain = losses(tmp_path/"exact"), losses(tmp_path/"plain")
    assert sorted(exact) == list(range(1, STEPS + 1)) and exact == two        # bit for bit, steps 11..30 included
    # the plain order: rounding only (under bf16 autocast, the DDP case's `auto` precision on CPU, a little more)
    assert max(abs(plain[s] - two[s]) / two[s] for s in two) < (1e-5 if fsdp == "true" else 5e-5)

FAIL_SECOND_SAVE = """
import errno, sys, unittest.mock as m
import gradient_garden.checkpoint.checkpoints as ck
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

FAIL_SECOND_SHARDED_WRITE = """
import errno, sys
from torch.distributed.checkpoint import FileSystemWriter
real, calls, kind = FileSystemWriter.write_data, [], sys.argv.pop(1)
# every shard file of a sharded save goes through here (a background thread: async)
def write_data(self, plan, planner):
    calls.append(1)
    if len(calls) > 1: raise KeyboardInterrupt if kind == "ctrl-c" else OSError(errno.ENOSPC, "No space left on device")
    return real(self, plan, planner)
FileSystemWriter.write_data = write_data
from gradient_garden.cli import main
sys.exit(main(sys.argv[1:]))
"""

@pytest.mark.parametrize("async_save,kind,cause", [
    (False, "enospc", "disk full (OSError: [Errno 28] No space left on device)"),
    (True, "enospc", "disk full (OSError: [Errno 28] No space left on device)"),
    (False, "ctrl-c", "interrupted (Ctrl-C)")])
def test_a_failed_sharded_write_is_one_line(prepared, tmp_path, async_save, kind, cause):
    "Sharded saves, synchronous or in the background: the one line, and the previous checkpoint stays the latest."
    r = subprocess.run([sys.executable, "-c", FAIL_SECOND_SHARDED_WRITE, kind, "train", "--recipe", RECIPE, "--set",
                        *sets(prepared, tmp_path, **{"training.max_steps": 8, "checkpointing.every": 4,
                                                     "checkpointing.format": "sharded",
                                                     "checkpointing.async_save": async_save})],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    ck = run_dir(tmp_path)/"checkpoints"
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.count("not written") == 1, r.stderr[-3000:]
    how = " (background write)" if async_save else ""
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: checkpoint of step 8 not written{how}: {cause}; the last intact checkpoint is {ck/'step_0000004'}")
    assert sorted(p.name for p in ck.iterdir()) == ["step_0000004"]  # the failed write left no directory behind

def test_ctrl_c_while_waiting_for_a_background_write(tmp_path):
    "A second Ctrl-C while the run waits for its background write: the one line; the write is never committed."
    from concurrent.futures import Future
    from gradient_garden.checkpoint.checkpoints import CheckpointManager, CheckpointWriteError, list_checkpoints
    mgr = CheckpointManager(tmp_path, keep_last=2, keep_best=False, async_save=True, raise_failures=True)
    meta = dict(stage="pretraining", architecture="tendril", config={})
    import torch
    mgr.save_sharded(4, {"model": {"w": torch.ones(3)}}, meta); mgr.wait()
    mgr.save_sharded(8, {"model": {"w": torch.ones(3)}}, meta)
    mgr.pending[0].result()  # written, not yet committed; then Ctrl-C arrives in the main thread's wait
    interrupted = Future(); interrupted.set_exception(KeyboardInterrupt())
    mgr.pending = (interrupted, *mgr.pending[1:])
    with pytest.raises(CheckpointWriteError) as e: mgr.wait()
    assert str(e.value) == (f"checkpoint of step 8 not written (background write): interrupted (Ctrl-C); "
                            f"the last intact checkpoint is {tmp_path/'step_0000004'}")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_0000004"]

def test_sigterm_to_gg_notebook_reaches_the_kernel(prepared, tmp_path):
    "SIGTERM to `gg notebook` (papermill's process; the kernel has a session of its own): checkpoint, report, one line."
    proc = subprocess.Popen(GG + ["notebook", "--recipe", RECIPE, "--set",
                                  *sets(prepared, tmp_path, **{"training.max_steps": 300})],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_rows(tmp_path, 3, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    line = stderr.strip().splitlines()[-1]
    step = int(line.split(" at step ")[1].split(":")[0])
    ck = run_dir(tmp_path)/"checkpoints"/f"step_{step:07d}.pt"
    assert proc.returncode == 128 + signal.SIGTERM and 3 <= step < 300, (proc.returncode, stderr[-3000:])
    assert line == f"stopped by SIGTERM at step {step}: checkpoint {ck}; resume with --checkpoint {run_dir(tmp_path)}"
    assert ck.is_file() and max(losses(tmp_path)) == step
    report = (run_dir(tmp_path)/"report.ipynb").read_text()
    assert "pretraining: stopped by SIGTERM" in report and '"ename"' not in report  # the report ran to its end
    assert f"report: {run_dir(tmp_path)/'report.ipynb'}" in stdout

@pytest.mark.slow
@pytest.mark.parametrize("async_save", [True])  # synchronous saves take the same path (dcp.save); ~11 s each
def test_a_sharded_write_failing_on_one_rank_stops_all(prepared, tmp_path, async_save):
    "2 gloo ranks, the disk fills on rank 1 only (in the background write): every rank stops, rank 0 says it once."
    script = tmp_path/"fail_on_rank_1.py"
    script.write_text(FAIL_SECOND_SHARDED_WRITE.replace(
        'if len(calls) > 1:', 'if len(calls) > 1 and __import__("os").environ["RANK"] == "1":'))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(script), "enospc",
                        "train", "--recipe", RECIPE, "--set",
                        *sets(prepared, tmp_path, **{"training.max_steps": 8, "checkpointing.every": 4,
                                                     "checkpointing.format": "sharded",
                                                     "checkpointing.async_save": async_save})],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    ck = run_dir(tmp_path)/"checkpoints"
    how = " (background write)" if async_save else ""
    line = (f"error: checkpoint of step 8 not written{how}: rank 1: disk full (OSError: [Errno 28] No space left on "
            "device); "
            f"the last intact checkpoint is {ck/'step_0000004'}")
    assert (r.returncode != 0 and r.stderr.count(line) == 1
            and r.stderr.count("step 8 not written") == 1), r.stderr[-4000:]
    assert "exit status 1: a checkpoint was not written" in r.stderr  # torchrun's summary points at the line
    assert sorted(p.name for p in ck.iterdir()) == ["step_0000004"]

def test_a_checkpoint_over_the_file_size_limit_is_one_line(prepared, tmp_path):
    ("A real write failure under RLIMIT_FSIZE (torch reports it as `enforce fail at inline_container.cc`): the cause, "
     "named.")
    import resource
    limit = 200_000                                            # above every log and config file, below one checkpoint
    r = subprocess.run(GG + ["train", "--recipe", RECIPE, "--set", *sets(prepared, tmp_path, **{"training.max_steps": 4,
                             "checkpointing.every": 4})], cwd=ROOT, env=ENV, capture_output=True, text=True,
                             timeout=300,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert r.returncode == 1 and "Traceback" not in r.stderr and "inline_container" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (
        "error: checkpoint of step 4 not written: file too large (OSError: [Errno 27] File too large; "
        f"the file-size limit, ulimit -f, is {limit:,} bytes); no earlier checkpoint exists")

def test_a_second_ctrl_c_within_a_second_aborts_at_once(prepared, tmp_path):
    "One process: Ctrl-C asks for a stop after the step; a second one 0.05 s later aborts mid-step, with no checkpoint."
    proc = subprocess.Popen(GG + ["train", "--recipe", RECIPE, "--set", *sets(prepared, tmp_path, **{
                            # ~1 s steps of 128 micro-batches
                            "training.max_steps": 1000, "training.total_batch_size": 32768})],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_rows(tmp_path, 1, proc)
    proc.send_signal(signal.SIGINT); time.sleep(0.05); proc.send_signal(signal.SIGINT)
    t0 = time.time()
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130 and stderr.strip().splitlines()[-1] == "interrupted", stderr[-3000:]
    assert "stopped by" not in stderr and time.time() - t0 < 30
    assert not list((run_dir(tmp_path)/"checkpoints").glob("step_*"))

@pytest.mark.slow
def test_sigterm_to_gg_launch_ends_with_our_line(prepared, tmp_path):
    ("torchrun's launcher run by `gg launch`: a SIGTERM to it saves on both ranks, and the last line and exit status "
     "are ours.")
    proc = subprocess.Popen(GG + ["launch", "--standalone", "--nproc-per-node", "2", "train", "--recipe", RECIPE,
                                  "--set", *sets(prepared, tmp_path)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for_rows(tmp_path, 3, proc)
    os.kill(proc.pid, signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    lines = stderr.strip().splitlines()
    assert proc.returncode == 143, stderr[-3000:]
    assert lines[-1] == ("gg launch: stopped by SIGTERM; the workers finished their step and saved: resume with the "
                         "--checkpoint the 'stopped by' line above names"), stderr[-3000:]
    assert "Traceback" not in stderr and "SignalException" not in stderr, stderr[-3000:]
    stopped = next(l for l in lines if l.startswith("stopped by SIGTERM at step "))
    step = int(stopped.split(" at step ")[1].split(":")[0])
    assert (run_dir(tmp_path)/"checkpoints"/f"step_{step:07d}"/"COMPLETE").is_file(), stopped


def test_gg_launch_names_the_failed_rank_in_its_last_line(prepared, tmp_path):
    r = run_gg("launch", "--standalone", "--nproc-per-node", "2", "train", "--recipe", RECIPE, "--set",
               *sets(prepared, tmp_path), f"paths.datasets={tmp_path/'nowhere'}", check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert lines[-1].startswith("gg launch: rank ") and lines[-1].endswith(
        "failed (exit status 2): exit status 2: bad input, said in one 'error:' line above"), lines[-1]
    assert any(l.startswith(f"error: {tmp_path/'nowhere'/'pretraining'}: no such data folder")
               for l in lines), r.stderr[-2000:]
