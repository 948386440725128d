"""Faults and bad input met when `gg` is tried as a new user would: each ends in one line of ours and a non-zero exit
status, never a traceback."""
import os, signal, subprocess, sys, time
from pathlib import Path
import psutil
import pytest
from conftest import GG, ROOT, run_gg

RECIPE = "recipes/pretraining/debug.yaml"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
WORKERS = "give the number of workers on this node (1 or more), or auto, cpu or gpu"
NODES = "give the number of nodes (1 or more), or MIN:MAX with 1 <= MIN <= MAX"

@pytest.mark.parametrize("flags,line", [
    (["--nproc-per-node", "0"], f"error: --nproc-per-node: got 0; {WORKERS}"),
    (["--standalone", "--nproc-per-node", "-1"], f"error: --nproc-per-node: got -1; {WORKERS}"),
    (["--nproc-per-node", "two"], f"error: --nproc-per-node: got two; {WORKERS}"),
    (["--nnodes", "0"], f"error: --nnodes: got 0; {NODES}"),
    (["--nnodes", "2:1"], f"error: --nnodes: got 2:1; {NODES}"),
    (["--max-restarts", "-1"], "error: --max-restarts: got -1; must be 0 or more"),
    (["--rdzv-backend", "c10"], "error: --rdzv-backend: got c10; one of c10d, etcd, etcd-v2, static"),
    (["--rdzv-endpoint", "localhost:abc"], "error: --rdzv-endpoint: got localhost:abc; expected HOST[:PORT] with "
                                           "PORT from 0 to 65535, e.g. head:29500"),
    (["--rdzv-conf", "join_timeout"], "error: --rdzv-conf: got join_timeout; expected KEY=VALUE pairs separated by "
                                      "commas, e.g. join_timeout=900")])
def test_a_bad_launcher_flag_is_one_line(flags, line):
    "Flags torchrun would refuse with a traceback (its `AssertionError`s and `ValueError`s): one line, exit status 2."
    r = run_gg("launch", *flags, "train", "--recipe", RECIPE, check=False, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines() == [line]

def notebook_sets(prepared, out: Path) -> list[str]:
    "A small CPU run under `out`, long enough that a stop signal always comes first."
    s = {"paths.runs": out/"runs", "training.max_steps": 300, "model.dim": 64, "model.n_layers": 2,
         "validation.enabled": False, "generation.every": 0, "checkpointing.every": 0, "runtime.device": "cpu"}
    return prepared["sets"] + [f"{k}={v}" for k, v in s.items()]

NO_CHECKPOINT = "stopped by SIGTERM at step 0: no checkpoint yet; run the same command again to start the run"

def stopped_at_start(proc, out: Path):
    "`gg notebook` stopped before its first step: exit status 143, the stop line last, no traceback, no retry."
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "Traceback" not in stderr and "retrying" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == NO_CHECKPOINT, stderr[-3000:]
    assert not (out/"runs"/"pretraining"/"debug"/"metrics.jsonl").is_file()    # it did not train after all

def gg_notebook(prepared, out: Path, *extra, launcher=GG):
    return subprocess.Popen(launcher + ["notebook", "--recipe", RECIPE, *extra, "--set", *notebook_sets(prepared, out)],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

def first_child(proc, timeout=120) -> psutil.Process:
    "The kernel: the first process `proc` starts."
    t0 = time.time()
    while time.time() - t0 < timeout:
        assert proc.poll() is None, proc.communicate()
        if kids := psutil.Process(proc.pid).children(): return kids[0]
        time.sleep(0.01)
    raise AssertionError("no kernel started")

def test_sigterm_while_the_kernel_starts_is_the_stop_line(prepared, tmp_path):
    "SIGTERM as soon as the kernel process exists (it dies before replying): no retry, the stop line, 143."
    proc = gg_notebook(prepared, tmp_path)
    first_child(proc)
    proc.send_signal(signal.SIGTERM)
    stopped_at_start(proc, tmp_path)

WAIT_CELL = "import pathlib, time\npathlib.Path({mark!r}).write_text('up')\ntime.sleep(120)"

def test_sigterm_while_the_first_cells_run_is_the_stop_line(prepared, tmp_path):
    "SIGTERM while the kernel runs a cell, before any training handler: the kernel dies (nbclient's DeadKernelError)."
    import nbformat
    mark, nb = tmp_path/"up", nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("recipe = None", metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell(WAIT_CELL.format(mark=str(mark)))]
    nbformat.write(nb, tmp_path/"wait.ipynb")
    proc = gg_notebook(prepared, tmp_path, "--notebook", tmp_path/"wait.ipynb")
    while not mark.is_file():
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    stopped_at_start(proc, tmp_path)

SIGNAL_BEFORE_THE_KERNEL = """
import os, signal, sys
import gradient_garden.cli.train as t
real = t._execute_report
def first_the_signal(*a, **k):
    os.kill(os.getpid(), signal.SIGTERM)   # the kernel process does not exist yet: no child takes the signal
    return real(*a, **k)
t._execute_report = first_the_signal
from gradient_garden.cli import main
sys.exit(main(sys.argv[1:]))
"""

def test_sigterm_before_the_kernel_exists_is_the_stop_line(prepared, tmp_path):
    "A signal no kernel took: the kernel that starts afterwards runs no cell (papermill's on_notebook_start hook)."
    stopped_at_start(gg_notebook(prepared, tmp_path, launcher=[sys.executable, "-c", SIGNAL_BEFORE_THE_KERNEL]),
                     tmp_path)

def test_validation_off_needs_no_validation_split(prepared, tmp_path):
    "A dataset prepared with data.val_fraction=0 trains with validation off; with it on, one line names both ways out."
    sets = [f"paths.datasets={tmp_path/'datasets'}", f"tokenizer.path={prepared['base']/'tokenizer'}",
            f"paths.evals={prepared['base']/'evals'}"]
    run_gg("prepare", "--recipe", RECIPE, "--set", *sets, "data.val_fraction=0", "data.target_tokens=200000")
    train = ["train", "--recipe", RECIPE, "--set", *sets, "training.max_steps=2",
             "model.dim=64", "model.n_layers=2", "generation.every=0", "evals.hellaswag=false",
             "evals.winogrande=false", "evals.arc_challenge=false", "runtime.device=cpu"]
    r = run_gg(*train, "validation.enabled=false", f"paths.runs={tmp_path/'a'}", check=False)
    assert r.returncode == 0 and "done: " in r.stdout, r.stderr[-3000:]
    r = run_gg(*train, "validation.enabled=true", f"paths.runs={tmp_path/'b'}", check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path/'datasets'/'pretraining'/'val'}: holds 0 windows of seq_len+1 = 257 tokens; one batch needs "
        "8 (batch_size 8 x world_size 1); prepare more data; or train without validation: validation.enabled=false")
