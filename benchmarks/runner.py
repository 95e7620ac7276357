"""The runner of `python -m benchmarks` and `python -m experiments`, one for both packages.

`python -m PACKAGE NAME [args...]` runs module NAME's `main`; alone or with --list it lists
the package's modules. The list is read from each module's
source (its docstring's first line, and whether it has a `main`), so listing imports no
module and no framework.
"""

import ast
import difflib
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = {"benchmarks": "benchmark", "experiments": "experiment"}  # package: what it holds


def modules(package: str) -> dict[str, ast.Module]:
    """Every module of `package` (its __main__ and __init__ aside), parsed."""
    found = {}
    for path in sorted((ROOT / package).glob("*.py")):
        if not path.stem.startswith("_"):
            found[path.stem] = ast.parse(path.read_text(), filename=str(path))
    return found


def describe(tree: ast.Module) -> str:
    return (ast.get_docstring(tree) or "").strip().split("\n", 1)[0] or "(no docstring)"


def has_main(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body)


def listing(package: str) -> str:
    trees = modules(package)
    runnable = {name: tree for name, tree in trees.items() if has_main(tree)}
    shared = {name: tree for name, tree in trees.items() if name not in runnable}
    width = max(map(len, trees))
    lines = [f"usage: python -m {package} NAME [args...]   (NAME --help for its flags)", ""]
    lines += [f"{package} and their workers:"]
    lines += [f"  {name:{width}}  {describe(tree)}" for name, tree in runnable.items()]
    if shared:
        lines += ["", "shared pieces (imported, not run):"]
        lines += [f"  {name:{width}}  {describe(tree)}" for name, tree in shared.items()]
    return "\n".join(lines)


def main(package: str, argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("--list", "-l", "list", "--help", "-h"):
        print(listing(package))
        return 0
    name, rest = argv[0], argv[1:]
    trees = modules(package)
    if name not in trees or not has_main(trees[name]):
        runnable = [n for n, tree in trees.items() if has_main(tree)]
        close = difflib.get_close_matches(name, runnable, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        print(
            f"unknown {KINDS[package]} {name!r}: {hint}`python -m {package} --list` lists them",
            file=sys.stderr,
        )
        return 2
    sys.argv = [f"{package} {name}", *rest]  # argparse's usage line names the module
    code = importlib.import_module(f"{package}.{name}").main(rest)
    # Some mains return their result (tests read it); only an int is an exit status.
    return code if isinstance(code, int) else 0
