"The book is read in the order of its layers: tools/check_order.py finds no notebook that imports a later one's module."
import json, shutil, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKER = ROOT/"tools"/"check_order.py"
sys.path.insert(0, str(ROOT/"tools"))
from check_order import inversions  # noqa: E402

def test_the_book_has_no_order_inversions():
    r = subprocess.run([sys.executable, str(CHECKER)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout
    assert "0 inversions" in r.stdout

def test_a_notebook_moved_before_its_imports_is_caught(tmp_path):
    nbs = tmp_path/"nbs"
    shutil.copytree(ROOT/"nbs", nbs, ignore=shutil.ignore_patterns("*.txt"))
    (nbs/"55_trainer.ipynb").rename(nbs/"39_trainer.ipynb")   # the trainer read before the optimizers it builds
    found = inversions(nbs, ROOT/"gradient_garden")
    assert "39_trainer (train.trainer) imports train.optim, built later in 51_optim" in found, found

def test_relative_imports_resolve_from_packages_and_modules(tmp_path):
    lib = tmp_path/"lib"/"pkg"
    (lib/"sub").mkdir(parents=True)
    (lib/"sub"/"__init__.py").write_text("from .leaf import x\nfrom ..top import y\n")
    (lib/"sub"/"leaf.py").write_text("x = 1\n")
    (lib/"top.py").write_text("y = 2\n")
    nbs = tmp_path/"nbs"; nbs.mkdir()
    def nb(name, module):
        (nbs/f"{name}.ipynb").write_text(json.dumps({"cells": [{"cell_type": "code",
                                                                "source": [f"#| default_exp {module}"]}]}))
    nb("00_sub", "sub.__init__"); nb("01_leaf", "sub.leaf"); nb("02_top", "top")
    import check_order
    found = check_order.inversions(nbs, tmp_path/"lib"/"pkg")
    assert sorted(found) == ["00_sub (sub) imports sub.leaf, built later in 01_leaf",
                             "00_sub (sub) imports top, built later in 02_top"], found

def test_the_index_lists_every_notebook_in_reading_order():
    import re
    from check_order import exported_module
    cells = json.loads((ROOT/"nbs"/"index.ipynb").read_text())["cells"]
    table = next("".join(c["source"]) for c in cells if "## The notebooks in reading order" in "".join(c["source"]))
    rows = re.findall(r"^\| \[(\w+)\]\((\w+)\.ipynb\) \| `([\w.]+)` \| (.+?) \|$", table, re.M)
    notebooks = sorted(p.stem for p in (ROOT/"nbs").glob("*.ipynb") if p.stem != "index")
    assert [r[0] for r in rows] == notebooks, sorted(set(notebooks) ^ {r[0] for r in rows})
    for name, link, module, summary in rows:
        assert link == name and summary.strip(), name
        assert module == f"gradient_garden.{exported_module(ROOT/'nbs'/f'{name}.ipynb')}", (name, module)

def test_an_import_by_a_literal_name_is_an_edge(tmp_path):
    lib = tmp_path/"lib"/"pkg"; lib.mkdir(parents=True)
    (lib/"low.py").write_text("import importlib\ndef load(): return importlib.import_module('gradient_garden.high')\n")
    (lib/"high.py").write_text("y = 2\n")
    nbs = tmp_path/"nbs"; nbs.mkdir()
    for name, module in (("00_low", "low"), ("01_high", "high")):
        (nbs/f"{name}.ipynb").write_text(json.dumps({"cells": [{"cell_type": "code",
                                                                "source": [f"#| default_exp {module}"]}]}))
    import check_order
    assert check_order.inversions(nbs, lib) == ["00_low (low) imports high, built later in 01_high"]
