"""A plain install, as a user gets it: the project built into a wheel and installed (not editable) into a fresh
virtual environment outside the checkout, where `gg notebook` runs from a folder with no `nbs/` and no `recipes/`
around it. The report notebook's template is package data; the copy committed here is kept clean."""
import json, os, shutil, subprocess, sys, sysconfig, zipfile
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT/"gradient_garden"/"assets"/"runs"/"train.ipynb"
RECIPE = ROOT/"recipes"/"pretraining"/"debug.yaml"

def run(cmd, **kw) -> subprocess.CompletedProcess:
    "Run `cmd`; fail with its output when it fails."
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kw)
    assert r.returncode == 0, f"{cmd} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return r

def test_the_template_is_clean_and_parameterised(tmp_path):
    ("nbdev-clean (which cleans nbs/ only) leaves the committed template as it is; papermill finds its `parameters` "
     "cell.")
    nbdev_clean = Path(sys.executable).parent/"nbdev-clean"
    if not nbdev_clean.exists(): pytest.skip("nbdev (the dev extra) is not installed")
    copy = tmp_path/"train.ipynb"; shutil.copy(TEMPLATE, copy)
    run([nbdev_clean, "--fname", copy], cwd=ROOT)   # the project's settings (ids, allowed metadata) come from its cwd
    assert copy.read_bytes() == TEMPLATE.read_bytes(), "run `make export` (it cleans the template too) and commit"
    cells = json.loads(TEMPLATE.read_text())["cells"]
    assert [c["id"] for c in cells if "parameters" in c["metadata"].get("tags", [])] == ["bb7b8d99"]

@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    "The bin/ of a fresh venv holding gradient_garden from a wheel, its dependencies reused from this environment."
    base = tmp_path_factory.mktemp("install")
    src = base/"src"   # built from a copy: a build in the checkout would write build/ and *.egg-info there
    shutil.copytree(ROOT/"gradient_garden", src/"gradient_garden", ignore=shutil.ignore_patterns("__pycache__"))
    for f in ["pyproject.toml", "README.md"]: shutil.copy(ROOT/f, src/f)
    run([sys.executable, "-m", "pip", "wheel", src, "--no-deps", "--no-build-isolation", "-q", "-w", base/"dist"])
    (wheel,) = (base/"dist").glob("gradient_garden-*.whl")
    assert "gradient_garden/assets/runs/train.ipynb" in zipfile.ZipFile(wheel).namelist()
    venv = base/"venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv])
    py = venv/"bin"/"python"
    run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", "--no-index", wheel])
    site = Path(run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    # a path line adds this environment's site-packages after the venv's own and runs none of its .pth files, so the
    # editable install of the checkout (a .pth-started import hook) cannot shadow the wheel
    (site/"_gg_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    where = run([py, "-c", "import gradient_garden; print(gradient_garden.__file__)"], cwd=base,
                env=env(py.parent)).stdout.strip()
    assert Path(where).is_relative_to(venv), where
    return venv/"bin"

def env(bin_dir: Path) -> dict:
    "The environment of a shell with the venv activated and training kept quiet and offline."
    e = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**e, "PATH": f"{bin_dir}{os.pathsep}{e.get('PATH', '')}", "VIRTUAL_ENV": str(bin_dir.parent),
            "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline"}

def small(prepared, out: Path) -> list[str]:
    "`--set` values of a two-step, one-process CPU run under `out`."
    s = {"paths.runs": out/"runs", "training.max_steps": 2, "training.log_every": 1, "model.dim": 64,
         "model.n_layers": 2,
         "model.n_heads": 4, "model.n_kv_heads": 2, "model.max_seq_len": 64, "training.seq_len": 64,
         "training.micro_batch_size": 4, "training.total_batch_size": 256, "validation.every": 2, "validation.steps": 1,
         "generation.every": 0, "evals.every": 0, "checkpointing.every": 2, "optimizers.adamw.warmup_steps": 1,
         "runtime.device": "cpu"}
    return prepared["sets"] + [f"{k}={v}" for k, v in s.items()]

def test_gg_notebook_runs_from_a_wheel_install(installed, prepared, tmp_path):
    "From a folder outside the checkout, the installed `gg notebook` finds its template and writes the report."
    shutil.copy(RECIPE, tmp_path/"debug.yaml")   # the user's own recipe file, next to where they run
    r = run([installed/"gg", "notebook", "--recipe", "debug.yaml", "--set", *small(prepared, tmp_path)],
            cwd=tmp_path, env=env(installed))
    report = tmp_path/"runs"/"pretraining"/"debug"/"report.ipynb"
    assert r.stdout.splitlines()[-1] == f"report: {report}", r.stdout[-2000:]
    nb = json.loads(report.read_text())
    assert Path(nb["metadata"]["papermill"]["input_path"]).is_relative_to(installed.parent)   # the wheel's template
    outs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
    assert any("image/png" in o.get("data", {}) for o in outs), "no plot in the report"

def test_a_missing_template_is_one_line(installed, prepared, tmp_path):
    "An install that lost its template says so in one line (exit status 2), naming the way out."
    where = Path(run([installed/"python", "-c",
                      "from gradient_garden.cli.train import default_train_notebook as d; print(d())"],
                     cwd=tmp_path, env=env(installed)).stdout.strip())
    assert where.is_relative_to(installed.parent) and where.is_file() and where.name == "train.ipynb"
    shutil.copy(RECIPE, tmp_path/"debug.yaml")
    where.rename(where.with_suffix(".gone"))
    try:
        r = subprocess.run([str(installed/"gg"), "notebook", "--recipe", "debug.yaml", "--set",
                            *small(prepared, tmp_path)],
                           cwd=tmp_path, env=env(installed), capture_output=True, text=True, timeout=300)
    finally: where.with_suffix(".gone").rename(where)
    assert r.returncode == 2 and r.stderr.strip() == (f"error: the report notebook template {where} is missing from "
                                                      "this install of gradient_garden; reinstall it, or pass "
                                                      "--notebook"), r.stderr
