"Shared fixtures: the embedded default corpus prepared once per session into a temporary folder."
import os, subprocess, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parent.parent
GG = [sys.executable, "-m", "gradient_garden.cli"]

def run_gg(*args, cwd=ROOT, env=None, check=True, timeout=900):
    "Run `gg ARGS` in a subprocess; return the CompletedProcess (stdout+stderr captured)."
    e = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    e = {k: v for k, v in e.items() if v is not None}  # None removes a variable
    r = subprocess.run(GG + [str(a) for a in args], cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"gg {' '.join(map(str, args))} failed "
                             f"({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
    return r

@pytest.fixture(scope="session")
def prepared(tmp_path_factory):
    "Paths overrides pointing at a session-wide prepared copy of the debug recipe's data."
    base = tmp_path_factory.mktemp("gg_data")
    sets = [f"paths.datasets={base/'datasets'}", f"tokenizer.path={base/'tokenizer'}", f"paths.evals={base/'evals'}"]
    run_gg("prepare", "--recipe", "recipes/pretraining/debug.yaml", "--set", *sets)
    return dict(base=base, sets=sets)

def kill_once_partly_written(proc, partial_files, timeout=120, min_bytes=1 << 20):
    "SIGKILL `proc` as soon as the first of `partial_files()` holds `min_bytes`; return that file's size then."
    import signal, time
    deadline, size = time.time() + timeout, 0
    try:
        while time.time() < deadline:
            files = partial_files()
            if files and (size := files[0].stat().st_size) > min_bytes: break
            assert proc.poll() is None, "writer finished before it could be killed"
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None: proc.kill()
    assert proc.returncode == -signal.SIGKILL
    return size

def pytest_collection_modifyitems(config, items):
    "Tests marked `slow` run with GG_HEAVY=1 (CI sets it); a plain `make test` skips them and says why."
    if os.environ.get("GG_HEAVY") == "1": return
    skip = pytest.mark.skip(reason="slow: runs with GG_HEAVY=1, as CI (.ci/run) does")
    for item in items:
        if "slow" in item.keywords: item.add_marker(skip)
