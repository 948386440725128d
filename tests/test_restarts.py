"""Restart-safe runs: the same command started again continues its run from the run directory's latest complete
checkpoint, after `kill -9` of one worker under `torchrun --max-restarts` and after the whole job is killed (a
requeue); the final weights equal an uninterrupted run's bit for bit. Another config in the same directory, and a live
holder of its lock, are refused in one line."""
import json, os, signal, socket, subprocess, sys, time
from pathlib import Path
import psutil
import pytest
import torch
from conftest import ROOT, run_gg
from test_train_e2e import RECIPE, small
from gradient_garden.checkpoint.checkpoints import list_checkpoints, load_checkpoint

STEPS = 12
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", "3", "-m", "gradient_garden.cli"]
# torchrun's agent shares its store with the workers, and a restarted worker group can read the previous attempt's
# addresses from it and fail to connect (pytorch/pytorch#135712): a store of their own for each attempt
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

def sets(prepared, out: Path, **extra) -> list[str]:
    "`small`'s overrides with a tiny Tendril in fp32, a checkpoint every 2 steps and no generation."
    tiny = {"model.dim": 64, "model.n_layers": 2, "model.max_seq_len": 64, "training.seq_len": 64,
            "training.micro_batch_size": 4, "training.total_batch_size": 1024, "runtime.device": "cpu",
            "runtime.precision": "fp32", "checkpointing.every": 2, "checkpointing.keep_last": 2,
            "checkpointing.format": "full", "generation.every": 0, "validation.every": 6, "validation.steps": 1}
    return small(prepared, out, steps=STEPS, **{**tiny, **extra})

def run_dir(out: Path) -> Path: return out/"runs"/"pretraining"/"debug"

def final_weights(out: Path) -> dict:
    "The model tensors of the run's checkpoint at its last step."
    ck = list_checkpoints(run_dir(out)/"checkpoints")[-1]
    assert ck.stem.split("_")[1] == f"{STEPS:07d}", ck
    return load_checkpoint(ck)["model"]

def assert_bit_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]

def start(args: list[str], log: Path) -> subprocess.Popen:
    "`torchrun ... gg ARGS` in a process group of its own (as a batch job is), its output into `log`."
    return subprocess.Popen(TORCHRUN + [str(a) for a in args], cwd=ROOT, env=ENV, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)

def wait_for_first_checkpoint(proc: subprocess.Popen, out: Path, timeout=300) -> str:
    "Poll the checkpoints folder until a complete checkpoint is there; its name."
    deadline = time.time() + timeout
    while time.time() < deadline:
        if found := list_checkpoints(run_dir(out)/"checkpoints"): return found[0].name
        assert proc.poll() is None, "the job ended before its first checkpoint"
        time.sleep(0.005)
    raise AssertionError("no checkpoint within the timeout")

def workers(proc: subprocess.Popen) -> dict[int, psutil.Process]:
    "rank -> worker process of the torchrun job `proc`."
    found = {}
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            if "gradient_garden.cli" in " ".join(p.cmdline()): found[int(p.environ()["RANK"])] = p
        except (psutil.Error, KeyError): pass
    return found

@pytest.fixture(scope="module")
def uninterrupted(prepared, tmp_path_factory):
    "The final weights of the recipe run on 2 ranks without interruption."
    out = tmp_path_factory.mktemp("uninterrupted")
    log = out/"log.txt"
    assert start(["train", "--recipe", RECIPE, "--set", *sets(prepared, out)], log).wait(timeout=600) == 0, \
        log.read_text()[-4000:]
    return final_weights(out)

def test_a_killed_worker_restarts_and_resumes(prepared, tmp_path, uninterrupted):
    args = ["train", "--recipe", RECIPE, "--set", *sets(prepared, tmp_path)]
    proc, log, t0 = start(args, tmp_path/"log.txt"), tmp_path/"log.txt", time.time()
    try:
        first = wait_for_first_checkpoint(proc, tmp_path)
        workers(proc)[1].send_signal(signal.SIGKILL)   # kill -9 rank 1: torchrun stops rank 0 and starts both again
        assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None: os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    restarts = text.count("failed (exitcode")   # torchrun's line for each failed attempt, each followed by a restart
    assert restarts == 1, text[-4000:]
    assert "holds this run: continuing from its latest complete checkpoint step_" in text, text[-4000:]
    print(f"first checkpoint {first}; {restarts} restart; {time.time() - t0:.1f} s")
    assert [json.loads(l)["step"] for l in (run_dir(tmp_path)/"metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(l)] == list(range(1, STEPS + 1))   # every step logged once
    assert_bit_equal(final_weights(tmp_path), uninterrupted)

def test_a_killed_job_started_again_resumes(prepared, tmp_path, uninterrupted):
    "The whole job SIGKILLed (launcher and workers), then the same command again: a requeue."
    args = ["train", "--recipe", RECIPE, "--set", *sets(prepared, tmp_path, **{"checkpointing.format": "sharded"})]
    proc = start(args, tmp_path/"log1.txt")
    try:
        wait_for_first_checkpoint(proc, tmp_path)
        job = [psutil.Process(proc.pid), *workers(proc).values()]   # torchrun puts its workers in sessions of their own
        for p in job: p.send_signal(signal.SIGKILL)                # so kill each, as a scheduler's cgroup kill does
        psutil.wait_procs(job, timeout=60)
    finally:
        if proc.poll() is None: os.killpg(proc.pid, signal.SIGKILL)
    lock = json.loads((run_dir(tmp_path)/".lock").read_text())   # left behind by the killed rank 0
    again = start(args, tmp_path/"log2.txt")
    assert again.wait(timeout=600) == 0, (tmp_path/"log2.txt").read_text()[-4000:]
    text = (tmp_path/"log2.txt").read_text()
    assert f"removed a stale lock (pid {lock['pid']} is no longer running)" in text, text[-4000:]
    assert "holds this run: continuing from its latest complete checkpoint step_" in text, text[-4000:]
    assert_bit_equal(final_weights(tmp_path), uninterrupted)   # sharded here, gathered there: the same tensors

def one_line_error(r) -> str:
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [l for l in r.stderr.splitlines() if l.startswith("error: ")]
    assert len(lines) == 1, r.stderr[-3000:]
    return lines[0]

def test_another_config_and_a_live_holder_are_refused(prepared, tmp_path):
    base = sets(prepared, tmp_path, **{"training.max_steps": 4})
    run_gg("train", "--recipe", RECIPE, "--set", *base)
    d = run_dir(tmp_path)
    line = one_line_error(run_gg("train", "--recipe", RECIPE, "--set", *base, "training.seed=7", check=False))
    assert line == (f"error: {d} holds another run (training.seed is 1337 there, 7 now): start this one beside it with "
                    "--set run.name=NEW_NAME, replace that one with --overwrite, or continue it with these settings "
                    f"with --checkpoint {d}"), line
    line = one_line_error(run_gg("train", "--recipe", RECIPE, "--set", *base, check=False))   # the same, finished
    assert line.startswith(f"error: {d}: this run already finished (step_0000004.pt, training.max_steps = 4)"), line
    (d/"checkpoints"/"step_0000004.pt").unlink()   # as if stopped at step 2: the same command would continue it...
    (d/".lock").write_text(json.dumps(dict(pid=os.getpid(), host=socket.gethostname(), since=0)))  # this test: alive
    line = one_line_error(run_gg("train", "--recipe", RECIPE, "--set", *base, check=False))   # ...but it is held
    assert f"another run is writing here (pid {os.getpid()} on {socket.gethostname()}" in line, line


def test_gg_notebook_started_again_continues_its_run(prepared, tmp_path):
    "`gg notebook`, the same command again after its process was killed, continues the run and writes its report."
    out = tmp_path/"nb"
    args = ["notebook", "--recipe", RECIPE, "--set", *sets(prepared, out)]
    proc = subprocess.Popen([sys.executable, "-m", "gradient_garden.cli", *args], cwd=ROOT, env=ENV,
                            stdout=(tmp_path/"first.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try: first = wait_for_first_checkpoint(proc, out)
    finally:  # the kernel runs in a session of its own: kill it and the verb, as a scheduler's cgroup kill would
        for p in psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]:
            p.kill()
        proc.wait(timeout=60)
    r = run_gg(*args)
    said = r.stdout + r.stderr
    assert f"continuing from its latest complete checkpoint {first}" in said, said[-3000:]
    assert list_checkpoints(run_dir(out)/"checkpoints")[-1].stem == f"step_{STEPS:07d}"
    assert (run_dir(out)/"report.ipynb").is_file()
