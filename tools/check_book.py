"""Check that the committed notebooks carry the outputs a fresh run produces (the book is readable without running it).

Usage: python tools/check_book.py COMMITTED_DIR EXECUTED_DIR

Both folders hold the same notebooks: COMMITTED_DIR as committed, EXECUTED_DIR after `nbdev-test --save`. Output
values may differ between runs (timings, temporary paths), so what is compared is which code cells show something:
a cell that shows a result when run (a display, a value or printed text; stderr aside) must show it in the committed notebook, a committed cell may not show output that
a run no longer produces, and no committed cell may hold an error. Exit 1 with one line per problem, naming the
notebook and the fix (`make book`).
"""
import json, sys
from pathlib import Path

def shows(cell) -> bool:
    "True when a code cell shows a result: a display, a value, or printed text (stderr, where warnings go, aside)."
    return any(o.get("output_type") != "stream" or (o.get("name") == "stdout" and "".join(o.get("text", "")).strip())
               for o in cell.get("outputs", []))

def problems(committed: Path, executed: Path) -> list[str]:
    "One line per notebook whose committed outputs do not match a fresh run."
    out = []
    for nb_path in sorted(committed.rglob("*.ipynb")):
        rel = nb_path.relative_to(committed)
        if ".ipynb_checkpoints" in rel.parts or rel.parts[0] == "runs": continue
        old = [c for c in json.loads(nb_path.read_text())["cells"] if c["cell_type"] == "code"]
        new = [c for c in json.loads((executed/rel).read_text())["cells"] if c["cell_type"] == "code"]
        if [c["source"] for c in old] != [c["source"] for c in new]:
            out.append(f"{rel}: cell sources differ between the two folders (compare the same commit)"); continue
        errors = [i for i, c in enumerate(old) if any(o.get("output_type") == "error" for o in c.get("outputs", []))]
        missing = [i for i, (a, b) in enumerate(zip(old, new)) if shows(b) and not shows(a)]
        stale = [i for i, (a, b) in enumerate(zip(old, new)) if shows(a) and not shows(b)]
        if errors: out.append(f"{rel}: code cells {errors} hold error outputs; run `make book` and commit")
        if missing: out.append(f"{rel}: code cells {missing} show output when run but not in the committed notebook; run `make book` and commit")
        if stale: out.append(f"{rel}: code cells {stale} show committed output that a run no longer produces; run `make book` and commit")
        if not any(shows(c) for c in old) and any(shows(c) for c in new):
            out.append(f"{rel}: no outputs committed")
    return out

if __name__ == "__main__":
    found = problems(Path(sys.argv[1]), Path(sys.argv[2]))
    for line in found: print(line)
    sys.exit(1 if found else 0)
