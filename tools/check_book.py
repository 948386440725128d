"""Check that the committed notebooks carry the outputs a fresh run produces (the book is readable without running it).

Usage: python tools/check_book.py COMMITTED_DIR EXECUTED_DIR   (outputs against a fresh run, and clean outputs)
       python tools/check_book.py NBS_DIR                        (clean outputs only)

Both folders hold the same notebooks: COMMITTED_DIR as committed, EXECUTED_DIR after `nbdev-test --save`. Output
values may differ between runs (timings, temporary paths), so what is compared is which code cells show something:
a cell that shows a result when run (a display, a value or printed text; stderr aside) must show it in the committed
notebook, a committed cell may not show output that a run no longer produces, and no committed cell may hold an error.
Exit 1 with one line per problem, naming the notebook and the fix (`make book`).

The committed outputs must also be clean, as a reader sees them: no absolute path of the machine that ran them (print
paths relative to the run or the repository), no stderr stream and no library warning (fix the cause, or silence it
with a sentence saying why), and no MFU above 100% (a figure measured against the wrong FLOP count).
"""
import json, re, sys
from pathlib import Path

ABSOLUTE_PATH = re.compile(r"(?<![\w.:/~-])/(?:tmp|home|root|work|Users|var|private|mnt|opt|usr|srv|scratch|media"
                           r"|workspace)/[\w.-]")
WARNING = re.compile(r"\b(?:\w+Warning|WARNING|Warning):")
MFU_PERCENT = re.compile(r"(?i)\bmfu\b\W{0,4}([0-9][0-9,]*(?:\.[0-9]+)?)\s*%")
MFU_FRACTION = re.compile(r"['\"]mfu['\"]\s*:\s*([0-9.]+(?:e[+-]?[0-9]+)?)")

def output_texts(cell):
    "(kind, text) of each output of a code cell: stream name or output type, and its text."
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream": yield o.get("name", "stdout"), "".join(o.get("text", ""))
        else:
            data = o.get("data", {})
            yield o.get("output_type"), "".join("".join(v) if isinstance(v, list) else str(v)
                                               for k, v in data.items() if k.startswith("text/"))

def unclean(cell) -> list[str]:
    "What a reader should not see in a code cell's outputs: absolute paths, stderr, warnings, an MFU over 100%."
    found = []
    for kind, text in output_texts(cell):
        if kind == "stderr": found.append("a stderr stream")
        if m := ABSOLUTE_PATH.search(text): found.append("an absolute path "
                                                         f"({text[m.start():m.start() + 40].split()[0]!r})")
        if WARNING.search(text): found.append("a warning")
        mfu = [float(x.replace(",", "")) for x in MFU_PERCENT.findall(text)] + [100 * float(x)
                                                                                for x in MFU_FRACTION.findall(text)]
        if any(x > 100 for x in mfu): found.append(f"an MFU of {max(mfu):.0f}%")
    return list(dict.fromkeys(found))

BASELINE = Path(__file__).with_name("book_outputs_baseline.json")   # cells not yet clean, per notebook: may only shrink

def book(nbs: Path):
    "(path relative to `nbs`, code cells) of each notebook of the book (Jupyter's checkpoints aside)."
    for nb_path in sorted(nbs.rglob("*.ipynb")):
        rel = nb_path.relative_to(nbs)
        if ".ipynb_checkpoints" in rel.parts: continue
        yield rel, [c for c in json.loads(nb_path.read_text())["cells"] if c["cell_type"] == "code"]

def dirty(nbs: Path) -> list[str]:
    "One line per code cell whose saved outputs are not clean."
    out = []
    for rel, cells in book(nbs):
        for i, c in enumerate(cells):
            if found := unclean(c): out.append(f"{rel}: code cell {i} shows {', '.join(found)}; fix the cause and "
                                               "rerun it")
    return out

def shows(cell) -> bool:
    "True when a code cell shows a result: a display, a value, or printed text (stderr, where warnings go, aside)."
    return any(o.get("output_type") != "stream" or (o.get("name") == "stdout" and "".join(o.get("text", "")).strip())
               for o in cell.get("outputs", []))

def problems(committed: Path, executed: Path) -> list[str]:
    "One line per notebook whose committed outputs do not match a fresh run."
    out = []
    for rel, old in book(committed):
        new = [c for c in json.loads((executed/rel).read_text())["cells"] if c["cell_type"] == "code"]
        if [c["source"] for c in old] != [c["source"] for c in new]:
            out.append(f"{rel}: cell sources differ between the two folders (compare the same commit)"); continue
        errors = [i for i, c in enumerate(old) if any(o.get("output_type") == "error" for o in c.get("outputs", []))]
        missing = [i for i, (a, b) in enumerate(zip(old, new)) if shows(b) and not shows(a)]
        stale = [i for i, (a, b) in enumerate(zip(old, new)) if shows(a) and not shows(b)]
        if errors: out.append(f"{rel}: code cells {errors} hold error outputs; run `make book` and commit")
        if missing: out.append(f"{rel}: code cells {missing} show output when run but not in the committed notebook; "
                               "run `make book` and commit")
        if stale: out.append(f"{rel}: code cells {stale} show committed output that a run no longer produces; run "
                             "`make book` and commit")
        if not any(shows(c) for c in old) and any(shows(c) for c in new):
            out.append(f"{rel}: no outputs committed")
    return out

def over_baseline(lines: list[str], baseline: dict) -> list[str]:
    "The dirty-output lines of notebooks with more unclean cells than the baseline allows them."
    per = {}
    for line in lines: per.setdefault(line.split(":", 1)[0], []).append(line)
    return [l for nb, ls in per.items() if len(ls) > baseline.get(nb, 0) for l in ls]

if __name__ == "__main__":
    baseline = json.loads(BASELINE.read_text()) if BASELINE.exists() else {}
    unclean_cells = dirty(Path(sys.argv[1]))
    if unclean_cells: print(f"note: {len(unclean_cells)} code cells with unclean outputs, within {BASELINE.name}",
                            file=sys.stderr)
    found = over_baseline(unclean_cells,
                          baseline) + (problems(Path(sys.argv[1]), Path(sys.argv[2])) if len(sys.argv) > 2 else [])
    for line in found: print(line)
    sys.exit(1 if found else 0)
