"""Fail when a notebook's module imports a module that a later notebook builds: the book is read in the order of its
layers.

Usage: python tools/check_order.py [nbs_dir]   (exit status 1 and one line per inversion when the order is broken)
"""
import ast, json, sys
from pathlib import Path

PACKAGE = "gradient_garden"
NAME_IMPORTS = ("import_module", "__import__")


def exported_module(nb_path):
    "The module a notebook exports to (its `#| default_exp`), or None."
    for cell in json.loads(nb_path.read_text())["cells"]:
        for line in "".join(cell["source"]).splitlines():
            if line.replace(" ", "").startswith("#|default_exp"):
                name = line.split("default_exp", 1)[1].strip()
                return name.removesuffix(".__init__")
    return None


def _called_name(call):
    "The name a call calls: `f` of `f(...)`, `attr` of `obj.attr(...)`."
    return getattr(call.func, "attr", None) or getattr(call.func, "id", None)


def package_imports(py_path, module):
    "Modules of the package that `module` (file `py_path`) imports, at any depth (statements and literal names)."
    tree = ast.parse(py_path.read_text())
    is_package = py_path.name == "__init__.py"
    parts = module.split(".") if is_package else module.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.removeprefix(PACKAGE + ".") for a in node.names if a.name.startswith(PACKAGE + ".")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[: len(parts) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                names = [target] + [f"{target}.{a.name}" if target else a.name for a in node.names]
            elif node.module and node.module.startswith(PACKAGE + "."):
                target = node.module.removeprefix(PACKAGE + ".")
                names = [target] + [f"{target}.{a.name}" for a in node.names]
            else:
                continue
            found |= set(names)
        elif isinstance(node, ast.Call) and _called_name(node) in NAME_IMPORTS:
            # an import by a name in a string is an edge too, where the string names a module of the package
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith(PACKAGE + "."):
                found.add(arg.value.removeprefix(PACKAGE + "."))
    return found


def inversions(nbs_dir, lib_dir):
    "One line per import of a module that is built by a later notebook."
    order = {}
    for nb in sorted(Path(nbs_dir).glob("[0-9]*.ipynb")):
        module = exported_module(nb)
        if module: order[module] = nb.stem
    lines = []
    for module, notebook in order.items():
        path = Path(lib_dir, *module.split("."))
        py = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        for imported in sorted(package_imports(py, module)):
            later = order.get(imported)
            if later and later > notebook and imported != module:
                lines.append(f"{notebook} ({module}) imports {imported}, built later in {later}")
    return lines


if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent
    nbs = Path(sys.argv[1]) if len(sys.argv) > 1 else root / "nbs"
    found = inversions(nbs, root / PACKAGE)
    print("\n".join(found) if found else "notebook order: 0 inversions")
    sys.exit(1 if found else 0)
