"""Check the book's house style: short code cells, and every exported piece followed by a check.

Usage: python tools/check_style.py [--summary] [--strict] [NB ...]      (default: every nbs/*.ipynb)

Two rules from the house style (`/work/shared/style.md`, CONTRIBUTING notes in the README):
- long: no code cell over 40 lines, unless its first line after the `#|` directives is a one-line reason,
  `# Kept whole: <reason>`; with `--strict` no reason excuses it.
- unchecked: each `#| export` / `#| exporti` / `#| exports` cell is followed, within the next three cells, by a
  code cell that is not exported and checks or shows something: it calls `test_eq`/`test_close`/`test_fail`/
  `test_ne`/`test_is`, asserts, prints, displays, plots, ends in a bare expression, or has a stored output.
  A cell that only imports (or only defines `__all__`) defines nothing to check and is exempt.
Cells marked `#| eval: false` never run, so they check nothing. Exit 1 with one line per problem, naming the
notebook and the cell (its index among all cells, as Jupyter counts them from 0); `--summary` prints the counts per
notebook instead, and the median length of the code cells checked (every source line, directives included; the
house aims at 8 or fewer).
"""
import argparse, ast, json, re, statistics, sys
from pathlib import Path

MAX_LINES = 40
WINDOW = 3
KEPT = re.compile(r"^#\s*Kept whole:\s*\S")
DIRECTIVE = re.compile(r"^#\s*\|\s*([\w-]+):?\s*(.*)$")
EXPORTS = {"export", "exporti", "exports"}
CHECK_CALL = re.compile(r"\b(test_eq|test_ne|test_close|test_fail|test_is|test_warns|test_stdout|assert\w*|print"
                        r"|display|show_doc|imshow|savefig)\b|\bplt\.|\.plot\(|\.hist\(|\.bar\(|\.scatter\(")

def source(cell) -> list[str]:
    "The cell's source lines, trailing blank lines dropped."
    text = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
    lines = text.split("\n")
    while lines and not lines[-1].strip(): lines.pop()
    return lines

def directives(lines: list[str]) -> dict[str, str]:
    "The leading `#| name value` directives of a cell."
    found = {}
    for line in lines:
        m = DIRECTIVE.match(line.strip())
        if not m: break
        found[m.group(1).lower()] = m.group(2).strip()
    return found

def body(lines: list[str]) -> list[str]:
    "The lines after the leading `#|` directives."
    i = 0
    while i < len(lines) and DIRECTIVE.match(lines[i].strip()): i += 1
    return lines[i:]

def is_export(lines) -> bool: return bool(EXPORTS & directives(lines).keys())

def runs(lines) -> bool: return directives(lines).get("eval", "").lower() not in ("false", "0", "no")

def python(lines: list[str]):
    "The cell's code parsed as Python (IPython magics and shell lines blanked), or None when it does not parse."
    code = "\n".join("" if l.lstrip().startswith(("%", "!")) else l for l in lines)
    try: return ast.parse(code)
    except SyntaxError: return None

def defines_nothing(lines: list[str]) -> bool:
    "True for a cell that only imports or sets `__all__`: nothing there for a check to test."
    tree = python(body(lines))
    if tree is None: return False
    def plain(node):
        if isinstance(node, (ast.Import, ast.ImportFrom)): return True
        if isinstance(node, ast.Assign): return all(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
        if isinstance(node, ast.Try): return all(plain(n) for n in node.body)
        return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    return all(plain(n) for n in tree.body)

def checks(cell) -> bool:
    "True for a non-exported, running code cell that checks or shows something."
    if cell["cell_type"] != "code": return False
    lines = source(cell)
    if is_export(lines) or not runs(lines): return False
    if cell.get("outputs"): return True
    code = body(lines)
    if any(CHECK_CALL.search(l.split("#", 1)[0] if not l.lstrip().startswith("#") else "") for l in code): return True
    tree = python(code)
    return bool(tree and tree.body and isinstance(tree.body[-1], ast.Expr)
                and not isinstance(tree.body[-1].value, ast.Constant))

def name_of(lines: list[str]) -> str:
    "The first name a cell defines, to help find it."
    for l in body(lines):
        m = re.match(r"\s*(?:@patch\s*)?(?:async\s+)?(?:def|class)\s+(\w+)|^(\w+)\s*[:=]", l)
        if m: return m.group(1) or m.group(2)
    return ""

def cell_lengths(nb_path: Path) -> list[int]:
    "The number of source lines of each code cell (directives included, trailing blank lines not)."
    return [len(source(c)) for c in json.loads(Path(nb_path).read_text())["cells"] if c["cell_type"] == "code"]

def problems(nb_path: Path, strict: bool = False) -> list[tuple[str, str]]:
    ("The notebook's style problems, as (kind, line) pairs with kind 'long' or 'unchecked'; `strict`: no long cell "
     "kept whole.")
    cells = json.loads(Path(nb_path).read_text())["cells"]
    out = []
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "code": continue
        lines = source(cell)
        what = name_of(lines)
        where = f"{nb_path}: cell {i}" + (f" ({what})" if what else "")
        rest = body(lines)
        if len(lines) > MAX_LINES and (strict or not (rest and KEPT.match(rest[0].strip()))):
            out.append(("long", f"{where} has {len(lines)} lines (over {MAX_LINES}); split it" +
                                ("" if strict else ", or start it with '# Kept whole: <reason>'")))
        if is_export(lines) and not defines_nothing(lines) and not any(checks(c) for c in cells[i+1:i+1+WINDOW]):
            out.append(("unchecked", f"{where} is exported but no check or visible output follows within "
                                     f"{WINDOW} cells"))
    return out

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Check the notebooks' house style (cell length, exported pieces checked).")
    p.add_argument("notebooks", nargs="*", type=Path, help="notebooks to check (default: nbs/*.ipynb)")
    p.add_argument("--summary", action="store_true",
                   help="print counts per notebook and the median cell length instead "
                                                           "of one line per problem")
    p.add_argument("--strict", action="store_true", help="a long cell is a problem even with a '# Kept whole:' reason")
    args = p.parse_args(argv)
    root = Path(__file__).resolve().parent.parent
    nbs = args.notebooks or sorted((root/"nbs").glob("*.ipynb"))
    nbs = [nb.relative_to(Path.cwd()) if nb.resolve().is_relative_to(Path.cwd()) else nb
           for nb in map(Path.absolute, nbs)]
    total, lengths = 0, []
    for nb in nbs:
        found = problems(nb, args.strict)
        lengths += cell_lengths(nb)
        total += len(found)
        if args.summary:
            long, unchecked = (sum(k == kind for k, _ in found) for kind in ("long", "unchecked"))
            if found: print(f"{nb}: {long} long, {unchecked} unchecked")
        else:
            for _, line in found: print(line)
    if args.summary:
        median = statistics.median(lengths) if lengths else 0
        print(f"code cells: {len(lengths)}, median {median:g} lines, {sum(n > MAX_LINES for n in lengths)} over "
              f"{MAX_LINES}")
        print(f"total: {total} problems in {len(nbs)} notebooks")
    return 1 if total else 0

if __name__ == "__main__":
    sys.exit(main())
