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
        raise AssertionError(f"gg {' '.join(map(str, args))} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
    return r

@pytest.fixture(scope="session")
def prepared(tmp_path_factory):
    "Paths overrides pointing at a session-wide prepared copy of the debug recipe's data."
    base = tmp_path_factory.mktemp("gg_data")
    sets = [f"paths.datasets={base/'datasets'}", f"tokenizer.path={base/'tokenizer'}", f"paths.evals={base/'evals'}"]
    run_gg("prepare", "--recipe", "recipes/pretraining/debug.yaml", "--set", *sets)
    return dict(base=base, sets=sets)
