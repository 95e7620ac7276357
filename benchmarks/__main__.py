"""`python -m benchmarks NAME [args...]`: run benchmark NAME; alone or with --list, list them.

The list is read from each module's source (its docstring's first line, and whether it
has a `main`), so listing imports no benchmark and no framework.
"""

import ast
import difflib
import importlib
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def modules() -> dict[str, ast.Module]:
    """Every module of the package (this runner and __init__ aside), parsed."""
    found = {}
    for path in sorted(PACKAGE.glob("*.py")):
        if not path.stem.startswith("_"):
            found[path.stem] = ast.parse(path.read_text(), filename=str(path))
    return found


def describe(tree: ast.Module) -> str:
    return (ast.get_docstring(tree) or "").strip().split("\n", 1)[0] or "(no docstring)"


def has_main(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body)


def listing() -> str:
    trees = modules()
    runnable = {name: tree for name, tree in trees.items() if has_main(tree)}
    shared = {name: tree for name, tree in trees.items() if name not in runnable}
    width = max(map(len, trees))
    lines = ["usage: python -m benchmarks NAME [args...]   (NAME --help for its flags)", ""]
    lines += ["benchmarks and their workers:"]
    lines += [f"  {name:{width}}  {describe(tree)}" for name, tree in runnable.items()]
    lines += ["", "shared pieces (imported, not run):"]
    lines += [f"  {name:{width}}  {describe(tree)}" for name, tree in shared.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("--list", "-l", "list", "--help", "-h"):
        print(listing())
        return 0
    name, rest = argv[0], argv[1:]
    trees = modules()
    if name not in trees or not has_main(trees[name]):
        runnable = [n for n, tree in trees.items() if has_main(tree)]
        close = difflib.get_close_matches(name, runnable, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        print(
            f"unknown benchmark {name!r}: {hint}`python -m benchmarks --list` lists them",
            file=sys.stderr,
        )
        return 2
    sys.argv = [f"benchmarks {name}", *rest]  # argparse's usage line names the benchmark
    code = importlib.import_module(f"benchmarks.{name}").main(rest)
    # Some mains return their result (tests read it); only an int is an exit status.
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
