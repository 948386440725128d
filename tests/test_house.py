"""The house's measurable rules for the package: modules a reader can hold in mind, no compatibility shims, one
number per notebook in its layer's band, and code cells short enough to read."""
import ast, re, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT/"gradient_garden"
MAX_MODULE_LINES = 600

def modules():
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "_modidx.py"]

def test_no_module_is_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, long

def test_exported_lines_fit_120_characters():
    "ruff's E501 on the package, less the first line of the `__all__` nbdev writes (wrapped at 120, then prefixed)."
    long = [f"{p.relative_to(ROOT)}:{i}" for p in modules() for i, line in enumerate(p.read_text().splitlines(), 1)
            if len(line) > 120 and not line.startswith("__all__ = [")]
    assert not long, f"{len(long)} lines over 120: {long[:20]}"

def test_no_compatibility_shims():
    "No module-level `__getattr__` (old names served lazily), no DeprecationWarning, no flag kept only as an old name."
    found = []
    for p in modules():
        text = p.read_text()
        tree = ast.parse(text)
        found += [f"{p.name}: module __getattr__" for n in tree.body if isinstance(n, ast.FunctionDef)
                  and n.name == "__getattr__"]
        found += [f"{p.name}: DeprecationWarning" for _ in re.finditer(r"DeprecationWarning", text)]
        found += [f"{p.name}: deprecated flag" for _ in re.finditer(r"(?i)help=\"deprecated", text)]
    assert not found, found

# the bands of the book: the first notebook number of each room, in the layers' order
BANDS = [(0, ("config", "runtime", "tokenizer", "data", "hardware", "checks", "recipes")), (10, ("models",)),
         (20, ("parallel",)), (26, ("checkpoint",)), (30, ("generation", "batching", "evals")), (40, ("stages",)),
         (50, ("train",)), (60, ("serve",)), (70, ("cli",))]

def band_of(module: str) -> int:
    "The first number of the band `module`'s room lives in."
    room = module.split(".")[0]
    return next(start for start, rooms in BANDS if room in rooms)

def test_one_number_per_notebook_each_in_its_band():
    sys.path.insert(0, str(ROOT/"tools"))
    from check_order import exported_module
    numbers, misplaced = {}, []
    for nb in sorted((ROOT/"nbs").glob("[0-9]*.ipynb")):
        prefix = nb.stem.split("_")[0]        # a number, or a number and a letter: a lesson read right after it (30a)
        n = int(re.match(r"\d+", prefix)[0])
        numbers.setdefault(prefix, []).append(nb.stem)
        module = exported_module(nb)
        if module is None: continue
        start = band_of(module)
        end = min([s for s, _ in BANDS if s > start], default=100)
        if not start <= n < end: misplaced.append(f"{nb.stem} ({module}): band {start}-{end - 1}")
    assert not {n: s for n, s in numbers.items() if len(s) > 1}, numbers
    assert not misplaced, misplaced

def test_code_cells_are_short():
    r = subprocess.run([sys.executable, str(ROOT/"tools"/"check_style.py"), "--summary"], capture_output=True,
                       text=True, timeout=120)
    m = re.search(r"code cells: (\d+), median (\d+) lines, (\d+) over 40", r.stdout)
    assert m, r.stdout[-2000:]
    assert int(m[2]) <= 8 and int(m[3]) == 0, m[0]
