"""Optional packages, imported where they are used: the model, the train step and the
benchmarks run without them, and a command that needs one says which, in one line."""

import importlib
from types import ModuleType

# Import name -> (distribution on PyPI, the jaxmoe extra that installs it).
OPTIONAL = {
    "tensorflow_datasets": ("tensorflow-datasets", "data"),
    "array_record": ("array-record", "data"),
    "grain": ("grain", "data"),
    "tensorboardX": ("tensorboardX", "data"),
    "jinja2": ("jinja2", "data"),  # chat templates (data.format=chat)
}


class MissingPackageError(ImportError, RuntimeError):
    """An optional package is not installed. A RuntimeError too, so the CLI prints it as its
    one error line; an ImportError, so `except ImportError` still sees it."""


def require(module: str, needed_for: str) -> ModuleType:
    """`module` imported, or MissingPackageError naming its distribution and jaxmoe extra."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        distribution, extra = OPTIONAL[module.split(".")[0]]
        raise MissingPackageError(
            f"{needed_for} needs {distribution}, which is not installed: "
            f"pip install 'jaxmoe[{extra}]' ({error})",
            name=module,
        ) from None
