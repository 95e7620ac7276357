"""The package's dependency order: no import cycles, and imports only point down the layers

    commands (cli/)
    conversions/ (T5X, HF, checkpoint surgery)
    training/, inference/, aot/
    models/, data/, checkpoints/   (config validation sits above models: it checks their
                                    options; data never reads a checkpoint: a command names
                                    a train.init_from checkpoint's tokenizer first)
    parallel/, storage/, config defaults (built from the sections' option dataclasses)
    compat/ (the one adapter to other libraries' private APIs), errors

checkpoints/ saves and restores trees, whatever model they belong to: it imports nothing
from models/ (a model's layer layout, models/stack.py, comes from the caller as the
`layouts` of restore_params; a converter of a scanned model stacks its tree before
save_params). What it needs of a config's meaning comes through config/.
No module outside compat/ imports another library's private module (`jax._src`,
`orbax.checkpoint._src`, any `_name` part) or reads a private attribute by name.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "jaxmoe"

BELOW_CONVERSIONS = (
    *("jaxmoe.checkpoints", "jaxmoe.training", "jaxmoe.models", "jaxmoe.data"),
    *("jaxmoe.inference", "jaxmoe.aot", "jaxmoe.parallel", "jaxmoe.storage"),
)

ABOVE_PLUMBING = (
    *("jaxmoe.models", "jaxmoe.data", "jaxmoe.checkpoints"),
    *("jaxmoe.training", "jaxmoe.inference", "jaxmoe.aot", "jaxmoe.cli"),
)

# Packages a package must never import (directly), by the order above.
FORBIDDEN = {
    "jaxmoe.models": ("jaxmoe.training", "jaxmoe.inference", "jaxmoe.cli", "jaxmoe.aot"),
    "jaxmoe.data": (
        *("jaxmoe.training", "jaxmoe.inference", "jaxmoe.cli", "jaxmoe.aot"),
        "jaxmoe.checkpoints",
    ),
    "jaxmoe.checkpoints": (
        *("jaxmoe.training", "jaxmoe.inference", "jaxmoe.cli", "jaxmoe.aot"),
        "jaxmoe.models",
    ),
    **{low: ABOVE_PLUMBING for low in ("jaxmoe.parallel", "jaxmoe.storage")},
    "jaxmoe.training": ("jaxmoe.cli", "jaxmoe.inference"),
    "jaxmoe.inference": ("jaxmoe.cli",),
    "jaxmoe.aot": ("jaxmoe.cli", "jaxmoe.inference"),
    "jaxmoe.errors": ("jaxmoe.",),
    "jaxmoe.conversions": ("jaxmoe.cli",),
}
# Conversions (T5X, HF, checkpoint surgery) sit above checkpoints and training (added to
# each entry: a second `**{...}` key in the literal would replace the entry, not extend it).
for _low in BELOW_CONVERSIONS:
    FORBIDDEN[_low] = (*FORBIDDEN[_low], "jaxmoe.conversions")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts).removesuffix(".__init__")
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """jaxmoe modules `name` imports anywhere in its body (function-level imports too)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_no_import_cycles():
    graph = _graph()
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if node.startswith(nxt + "."):  # a module importing its own package's __init__
                continue
            if state.get(nxt) == "open":
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_imports_point_down_the_layers():
    wrong = [
        f"{name} imports {target}"
        for name, targets in _graph().items()
        for package, banned in FORBIDDEN.items()
        if name == package or name.startswith(package + ".")
        for target in targets
        if any(target == b or target.startswith(b if b.endswith(".") else b + ".") for b in banned)
    ]
    assert not wrong, "\n".join(wrong)


def test_top_level_holds_only_the_entry_points_and_errors():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "errors.py"]


COMPAT = "jaxmoe.compat"


def _private(module: str) -> bool:
    """Whether a dotted module name has a private part (`_src`; `__main__` is public)."""
    return any(p.startswith("_") and not p.startswith("__") for p in module.split("."))


def _outside_imports(path: Path):
    """(line, module, names) of each import of a module outside jaxmoe in `path`."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, ()
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            yield node.lineno, node.module, tuple(alias.name for alias in node.names)


def test_private_apis_only_in_compat():
    wrong = []
    for name, path in _modules().items():
        if name == COMPAT or name.startswith(COMPAT + "."):
            continue
        where = path.relative_to(PACKAGE.parent)
        for line, module, names in _outside_imports(path):
            if module.split(".")[0] == "jaxmoe":
                continue
            private_names = [n for n in names if _private(n)]
            if _private(module) or private_names:
                wrong.append(f"{where}:{line} imports {module} {private_names or ''}")
        for node in ast.walk(ast.parse(path.read_text())):
            is_call = isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            if is_call and node.func.id in ("getattr", "hasattr") and len(node.args) > 1:
                key = node.args[1]
                if isinstance(key, ast.Constant) and _private(str(key.value)):
                    wrong.append(f"{where}:{node.lineno} reads attribute {key.value!r}")
    assert not wrong, "private APIs belong in jaxmoe/compat/private_apis.py:\n" + "\n".join(wrong)


def test_compat_imports_only_errors():
    wrong = [
        f"{name} imports {target}"
        for name, targets in _graph().items()
        if name == COMPAT or name.startswith(COMPAT + ".")
        for target in targets
        if not (target == "jaxmoe.errors" or target.startswith(COMPAT))
    ]
    assert not wrong, "\n".join(wrong)


# The config schema (jaxmoe/config/schema.py): each section's dataclass lives with the package
# it configures and imports only SCHEMA_BASE and that package's own option lists; the
# defaults and the typed view import those schema modules, never training's internals,
# inference or the commands (validation used to import training for its option lists).
SCHEMA_MODULES = {
    "jaxmoe.models.options": "jaxmoe.models",
    "jaxmoe.training.options": "jaxmoe.training",
    "jaxmoe.data.options": "jaxmoe.data",
    "jaxmoe.parallel.options": "jaxmoe.parallel",
}
CONFIG_BASE = ("jaxmoe.config.defaults", "jaxmoe.config.schema")
SCHEMA_BASE = ("jaxmoe.errors", "jaxmoe.config.fields")  # what a schema module may import


def test_config_schema_imports_no_training_inference_or_commands():
    graph = _graph()
    wrong = [
        f"{name} imports {target}"
        for name, package in SCHEMA_MODULES.items()
        for target in graph[name]
        if not (target in SCHEMA_BASE or target.startswith(package + "."))
    ]
    wrong += [
        f"{name} imports {target}"
        for name in CONFIG_BASE
        for target in graph[name]
        if not (target in SCHEMA_MODULES or target.startswith(("jaxmoe.config", "jaxmoe.errors")))
    ]
    assert not wrong, "\n".join(wrong)
