"The package's layering, enforced by import-linter's contracts in pyproject.toml (and shown to catch a violation)."
import os, shutil, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT = [str(Path(sys.executable).with_name("lint-imports")), "--no-cache"]

def lint(root: Path) -> subprocess.CompletedProcess:
    "Run lint-imports with `root`'s pyproject.toml on `root`'s copy of the package."
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(LINT, cwd=root, env=env, capture_output=True, text=True, timeout=300)

def test_the_layers_hold():
    r = lint(ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout

def test_an_upward_import_breaks_the_build(tmp_path):
    shutil.copytree(ROOT/"gradient_garden", tmp_path/"gradient_garden", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT/"pyproject.toml", tmp_path/"pyproject.toml")
    tendril = tmp_path/"gradient_garden"/"models"/"tendril.py"
    tendril.write_text(tendril.read_text() + "\nfrom gradient_garden.train import trainer  # a model reaching into the training loop\n")
    r = lint(tmp_path)
    assert r.returncode != 0 and "BROKEN" in r.stdout
    assert "gradient_garden.models.tendril -> gradient_garden.train.trainer" in r.stdout
