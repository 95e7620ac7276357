"""The package's dependency order: no import cycles, and every import points down (or
sideways within a floor, where allowed) this order, floor by floor:

    commands     cli/
    conversions  conversions/ (T5X, HF, checkpoint surgery)
    runs         training/, inference/, aot/, config/ (JobConfig, config files, stored configs)
    blocks       models/, data/, checkpoints/
    plumbing     parallel/, storage/
    bottom       compat/ (the one adapter to other libraries' private APIs), errors, fields
                 (what every config section is written with)

Each section's dataclass lives with the package it configures (models/options.py,
training/options.py, ...), and config/ composes them into JobConfig, so config/ sits beside
training/ on the runs floor, above the blocks whose sections it builds.

Sideways imports within a floor are allowed except: training and aot never import
inference; config imports no other run; data never reads a checkpoint (a command names a
train.init_from checkpoint's tokenizer first); checkpoints/ saves and restores trees,
whatever model they belong to, and imports nothing from models/ (a model's layer layout,
models/stack.py, comes from the caller as the `layouts` of restore_params; a converter of a
scanned model stacks its tree before save_params), and stores configs as plain dicts
(config/ reads them back, typed).
No module outside compat/ imports another library's private module (`jax._src`,
`orbax.checkpoint._src`, any `_name` part) or reads a private attribute by name.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "jaxmoe"

# Top floor first; the entry points (jaxmoe/__init__.py, __main__.py) stand above them all.
FLOORS = (
    ("jaxmoe.cli",),
    ("jaxmoe.conversions",),
    ("jaxmoe.training", "jaxmoe.inference", "jaxmoe.aot", "jaxmoe.config"),
    ("jaxmoe.models", "jaxmoe.data", "jaxmoe.checkpoints"),
    ("jaxmoe.parallel", "jaxmoe.storage"),
    ("jaxmoe.compat", "jaxmoe.errors", "jaxmoe.fields"),
)
# Sideways imports a floor forbids.
SIDEWAYS = {
    "jaxmoe.training": ("jaxmoe.inference",),
    "jaxmoe.aot": ("jaxmoe.inference",),
    "jaxmoe.config": ("jaxmoe.inference", "jaxmoe.aot", "jaxmoe.training"),
    "jaxmoe.data": ("jaxmoe.checkpoints",),
    "jaxmoe.checkpoints": ("jaxmoe.models",),
    "jaxmoe.compat": ("jaxmoe.fields",),
    "jaxmoe.errors": ("jaxmoe.compat", "jaxmoe.fields"),
    "jaxmoe.fields": ("jaxmoe.compat",),
}
# config/ composes the sections: the schema modules of the runs floor are its to import.
SECTION_MODULES = ("jaxmoe.training.options",)


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


def _package(module: str) -> str | None:
    for floor in FLOORS:
        for package in floor:
            if module == package or module.startswith(package + "."):
                return package
    return None


def _floor(package: str) -> int:
    return next(i for i, floor in enumerate(FLOORS) if package in floor)


def test_every_package_has_a_floor():
    unplaced = sorted(
        name for name in _modules() if name not in ("jaxmoe", "jaxmoe.__main__")
        if _package(name) is None
    )  # fmt: skip
    assert not unplaced, f"modules on no floor of FLOORS: {unplaced}"


def test_imports_point_down_the_layers():
    wrong = []
    for name, targets in _graph().items():
        source = _package(name)
        if source is None:  # the entry points
            continue
        for target in targets:
            dest = _package(target)
            if dest is None or dest == source:
                continue
            up = _floor(dest) < _floor(source)
            banned = dest in SIDEWAYS.get(source, ())
            if banned and target in SECTION_MODULES and source == "jaxmoe.config":
                banned = False
            if up or banned:
                wrong.append(f"{name} imports {target}")
    assert not wrong, f"{len(wrong)} imports against the floors:\n" + "\n".join(sorted(wrong))


def test_top_level_holds_only_the_entry_points_and_errors():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "errors.py", "fields.py"]


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


# NamedTuple's own public method, spelled with an underscore.
PUBLIC_UNDERSCORED = ("_replace",)


def test_modules_keep_their_private_names():
    """A name with a leading underscore is its module's own: no other jaxmoe module imports
    it, and no code reads one off another object than `self` / `cls` (a caller that needs it
    gets a public name, or the owning module does the work)."""
    wrong = []
    for path in _modules().values():
        where = path.relative_to(PACKAGE.parent)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxmoe"):
                names = [a.name for a in node.names if _private(a.name)]
                if names:
                    wrong.append(f"{where}:{node.lineno} imports {node.module} {names}")
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                owner = node.value
                mine = isinstance(owner, ast.Name) and owner.id in ("self", "cls")
                if not mine and node.attr not in PUBLIC_UNDERSCORED:
                    wrong.append(f"{where}:{node.lineno} reads {ast.unparse(node)}")
    assert not wrong, "private names used outside their module:\n" + "\n".join(wrong)


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
# it configures and imports only the bottom floor and that package's own option lists; the
# schema and the defaults import those section modules, never training's internals,
# inference or the commands.
SCHEMA_MODULES = {
    "jaxmoe.models.options": "jaxmoe.models",
    "jaxmoe.training.options": "jaxmoe.training",
    "jaxmoe.data.options": "jaxmoe.data",
    "jaxmoe.parallel.options": "jaxmoe.parallel",
}
CONFIG_BASE = ("jaxmoe.config.defaults", "jaxmoe.config.schema")
SCHEMA_BASE = ("jaxmoe.errors", "jaxmoe.fields")  # what a section module may import


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
        if not (target in SCHEMA_MODULES or target.startswith(("jaxmoe.config", *SCHEMA_BASE)))
    ]
    assert not wrong, "\n".join(wrong)
