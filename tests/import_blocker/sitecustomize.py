"""An import blocker for subprocesses of the tests: put this folder first on PYTHONPATH.

JAXMOE_BLOCK=a,b,c        top-level modules that import as if not installed
JAXMOE_ALLOW_ONLY=a,b,c   or: every module outside the standard library and this list is
                          blocked (an environment holding only those packages)
JAXMOE_ALLOW_UNDER=D1:D2  a blocked module still imports when found under these folders
                          (a private --target install)
JAXMOE_IMPORTS_REPORT=D   at exit, D/modules-PID.txt lists the top-level modules imported

`importlib.util.find_spec` answers None for a blocked module and `importlib.metadata`
raises PackageNotFoundError, as they would if it were absent.
"""

import atexit
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
import sysconfig


def _names(key: str) -> set[str]:
    return {n for n in os.environ.get(key, "").split(",") if n}


BLOCKED = _names("JAXMOE_BLOCK")
ALLOW_ONLY = _names("JAXMOE_ALLOW_ONLY")
ALLOW_UNDER = [
    os.path.realpath(d) for d in os.environ.get("JAXMOE_ALLOW_UNDER", "").split(":") if d
]
HERE = os.path.dirname(os.path.realpath(__file__))
# The standard library's folders (private modules such as _sysconfigdata_* are not in
# sys.stdlib_module_names); site-packages below them is not the standard library.
STDLIB = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib")}
SITE = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")}


class Blocked(ModuleNotFoundError):
    pass


def _is_blocked_name(top: str) -> bool:
    if ALLOW_ONLY:
        return top not in ALLOW_ONLY and top not in sys.stdlib_module_names
    return top in BLOCKED


class _Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if name != top or top in sys.builtin_module_names or not _is_blocked_name(top):
            return None  # a submodule follows its package, which passed here first
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.origin in (None, "frozen"):
            return None
        where = os.path.realpath(spec.origin)
        if where.startswith(HERE) or any(where.startswith(d + os.sep) for d in ALLOW_UNDER):
            return spec
        in_stdlib = any(where.startswith(d + os.sep) for d in STDLIB)
        if in_stdlib and not any(where.startswith(d + os.sep) for d in SITE):
            return spec
        raise Blocked(f"No module named {name!r} (blocked by tests/import_blocker)", name=name)


_find_spec = importlib.util.find_spec


def _find_spec_or_none(name, package=None):
    try:
        return _find_spec(name, package)
    except Blocked:
        return None


_distribution = importlib.metadata.distribution


def _unblocked_distribution(name):
    dist = _distribution(name)
    top_names = (dist.read_text("top_level.txt") or "").split() or [name.replace("-", "_")]
    path = os.path.realpath(str(dist.locate_file("")))
    allowed = any(path.startswith(d) for d in ALLOW_UNDER)
    if not allowed and any(_is_blocked_name(t) for t in top_names):
        raise importlib.metadata.PackageNotFoundError(name)
    return dist


def _report() -> None:
    folder = os.environ.get("JAXMOE_IMPORTS_REPORT")
    if folder:
        tops = sorted({m.partition(".")[0] for m in list(sys.modules)})
        with open(os.path.join(folder, f"modules-{os.getpid()}.txt"), "w") as out:
            out.write("\n".join(tops) + "\n")


if BLOCKED or ALLOW_ONLY:
    sys.meta_path.insert(0, _Blocker())
    importlib.util.find_spec = _find_spec_or_none
    importlib.metadata.distribution = _unblocked_distribution
    importlib.metadata.version = lambda name: _unblocked_distribution(name).version
atexit.register(_report)
