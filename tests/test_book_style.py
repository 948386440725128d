"""The book's house style, checked by tools/check_style.py: no code cell over 40 lines (the book itself: none, reason or
not), and every exported piece followed within three cells by a check (and the checker shown to catch a notebook that
breaks both)."""
import json, re, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKER = ROOT/"tools"/"check_style.py"

def check(*args, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECKER), *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=120)

def notebook(path: Path, *cells: tuple[str, str]) -> Path:
    "Write a notebook of (cell_type, source) pairs."
    nb = {"cells": [{"cell_type": t, "metadata": {}, "source": s, **({"outputs": [], "execution_count": None}
                     if t == "code" else {})} for t, s in cells],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(nb))
    return path

def test_every_notebook_follows_the_house_style():
    "Strict: no code cell over 40 lines, reason or not; and the book's code cells have a median of at most 8 lines."
    r = check("--strict")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    summary = check("--summary", "--strict").stdout
    median = float(re.search(r"median ([\d.]+) lines", summary).group(1))
    assert median <= 8, summary

def test_the_checker_catches_a_long_cell_and_an_unchecked_export(tmp_path):
    long = "#| export\ndef walk(n):\n    \"Count to n.\"\n" + "".join(f"    x{i} = {i}\n"
                                                                      for i in range(40)) + "    return n\n"
    bad = notebook(tmp_path/"bad.ipynb", ("markdown", "# Bad"), ("code", "#| export\nimport torch"),
                   ("code", long), ("markdown", "It walks."), ("code", "#| export\ndef other(): return 1"),
                   ("markdown", "Nothing checks it."))
    r = check(bad)
    assert r.returncode == 1
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 3, r.stdout   # the long cell, and both exports (the import-only cell is exempt)
    assert "cell 2 (walk) has 44 lines (over 40)" in lines[0]
    assert "cell 2 (walk) is exported but no check" in lines[1]
    assert "cell 4 (other) is exported but no check" in lines[2]
    s = check("--summary", bad)
    assert s.returncode == 1 and "bad.ipynb: 1 long, 2 unchecked" in s.stdout and "total: 3 problems" in s.stdout

def test_the_checker_passes_a_notebook_that_follows_the_style(tmp_path):
    long = "#| export\n# Kept whole: one table the reader reads top to bottom\nTABLE = {\n" + \
           "".join(f"    {i}: {i},\n" for i in range(40)) + "}\n"
    good = notebook(tmp_path/"good.ipynb", ("code", long), ("markdown", "The table."), ("code", "test_eq(TABLE[3], 3)"),
                    ("code", "#| export\ndef one(): return 1"), ("code", "#| eval: false\nassert one() == 1"),
                    ("code", "one()"), ("code", "#| exporti\ndef two(): return 2"), ("code", "two()  # shown"))
    r = check(good)
    assert r.returncode == 0, r.stdout
    bad = json.loads(good.read_text())
    bad["cells"][5]["source"] = "x = one()"    # without the bare expression nothing that runs checks `one`
    (tmp_path/"bad.ipynb").write_text(json.dumps(bad))
    r = check(tmp_path/"bad.ipynb")
    assert r.returncode == 1 and "cell 3 (one) is exported" in r.stdout

def test_the_summary_gives_the_median_and_strict_refuses_kept_whole_cells(tmp_path):
    kept = "#| export\n# Kept whole: one table\nTABLE = {\n" + "".join(f"    {i}: {i},\n" for i in range(40)) + "}\n"
    nb = notebook(tmp_path/"nb.ipynb", ("code", kept), ("code", "test_eq(TABLE[3], 3)"),
                  ("code", "x = 1\ny = 2\nx + y"))
    s = check("--summary", nb)
    assert s.returncode == 0 and "code cells: 3, median 3 lines, 1 over 40" in s.stdout, s.stdout
    strict = check("--strict", nb)
    assert strict.returncode == 1 and "cell 0 (TABLE) has 44 lines (over 40); split it" in strict.stdout, strict.stdout
    assert "Kept whole" not in strict.stdout
