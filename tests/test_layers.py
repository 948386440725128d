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
    tendril.write_text(tendril.read_text() + "\nfrom gradient_garden.train import trainer  # a model reaching into the "
                                             "training loop\n")
    r = lint(tmp_path)
    assert r.returncode != 0 and "BROKEN" in r.stdout
    assert "gradient_garden.models.tendril -> gradient_garden.train.trainer" in r.stdout

# Every import inside the package is a plain `import` that the graph sees: the only imports by a name held in a string
# are of a user's module named in a config, `training.stage: module:attr` and `rl.reward_functions`.
NAME_IMPORTS_ALLOWED = {"stages/registry.py", "stages/rewards.py"}

def name_string_imports(package: Path) -> dict[str, int]:
    "`importlib.import_module(...)` / `import_module(...)` / `__import__(...)` calls per module file of `package`."
    import ast
    found = {}
    for py in sorted(package.rglob("*.py")):
        calls = [n for n in ast.walk(ast.parse(py.read_text())) if isinstance(n, ast.Call)
                 and (getattr(n.func, "attr", None) or getattr(n.func, "id", None)) in ("import_module", "__import__")]
        if calls: found[py.relative_to(package).as_posix()] = len(calls)
    return found

def test_no_module_imports_the_package_by_name_strings():
    found = name_string_imports(ROOT/"gradient_garden")
    assert set(found) == NAME_IMPORTS_ALLOWED, found

CYCLES = """
import grimp, json, sys
graph = grimp.build_graph("gradient_garden", cache_dir=None)
edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}
index, low, stack, on, found = {}, {}, [], set(), []
def visit(v):   # Tarjan: the strongly connected components of more than one module (or a module importing itself)
    index[v] = low[v] = len(index); stack.append(v); on.add(v)
    for w in edges[v]:
        if w not in index: visit(w); low[v] = min(low[v], low[w])
        elif w in on: low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        group = []
        while not group or group[-1] != v: group.append(stack.pop()); on.discard(group[-1])
        if len(group) > 1 or v in edges[v]: found.append(sorted(group))
sys.setrecursionlimit(10_000)
for m in edges:
    if m not in index: visit(m)
print(json.dumps(found))
"""

def import_cycles(root: Path) -> list[list[str]]:
    "Groups of modules of `root`'s copy of the package that import each other, from grimp's import graph."
    import json
    r = subprocess.run([sys.executable, "-c", CYCLES], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)

def test_the_import_graph_has_no_cycle():
    # a package's __init__ may import its own modules (the verb table imports each verb) only where none imports it back
    assert import_cycles(ROOT) == []

def test_a_verb_importing_the_verb_table_is_a_cycle(tmp_path):
    shutil.copytree(ROOT/"gradient_garden", tmp_path/"gradient_garden", ignore=shutil.ignore_patterns("__pycache__"))
    train = tmp_path/"gradient_garden"/"cli"/"train.py"
    train.write_text(train.read_text() + "\nfrom gradient_garden.cli import VERBS  # a verb reaching back into the "
                                         "table\n")
    assert import_cycles(tmp_path) == [["gradient_garden.cli", "gradient_garden.cli.train"]]
