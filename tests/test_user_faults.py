"""Faults and bad input met when `gg` is tried as a new user would: each ends in one line of ours and a non-zero exit
status, never a traceback."""
import pytest
from conftest import run_gg

RECIPE = "recipes/pretraining/debug.yaml"
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
