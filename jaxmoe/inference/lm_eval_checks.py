"""`jaxmoe lm-eval`'s paths checked before lm-eval starts: lm-eval skips a task file it cannot
read without a word (the task is then "not found"), renders a template with a syntax error
only after the model is loaded (a 60-line traceback), says nothing of an `--include_path`
that does not exist, and only logs that it could not save `--output_path`.

Here each is one line naming the flag and the file: the task files under `--include_path`
are parsed as YAML and their Jinja templates compiled with lm-eval's own environment, and
`--output_path` must be writable.
"""

import argparse
from pathlib import Path

from jaxmoe.checkpoints.staging import check_writable
from jaxmoe.errors import CheckpointError, ConfigError


def _flags(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--include_path", default=None)
    parser.add_argument("--output_path", "-o", default=None)
    try:
        return parser.parse_known_args(argv)[0]
    except SystemExit:  # lm-eval's own parser reports it in its words
        return argparse.Namespace(include_path=None, output_path=None)


def _templates(node, yaml):
    """(string value, its line) of every scalar in a composed YAML node tree that holds a
    Jinja template."""
    if isinstance(node, yaml.ScalarNode):
        if isinstance(node.value, str) and ("{{" in node.value or "{%" in node.value):
            yield node.value, node.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            yield from _templates(item, yaml)
    elif isinstance(node, yaml.MappingNode):
        for _, value in node.value:
            yield from _templates(value, yaml)


def check_task_file(path: Path) -> None:
    """ConfigError naming `path` (and the line) when it is not YAML or one of its Jinja
    templates does not compile."""
    import jinja2
    import yaml
    from lm_eval.utils import env as lm_eval_templates

    try:
        # compose: the syntax only, so lm-eval's own tags (!function) need no constructor.
        node = yaml.compose(path.read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"--include_path: {path}: unreadable ({error})") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"--include_path: {path}{where}: not valid YAML ({problem})") from None
    for template, line in _templates(node, yaml) if node is not None else ():
        try:
            lm_eval_templates.from_string(template)
        except jinja2.TemplateSyntaxError as error:
            raise ConfigError(
                f"--include_path: {path}:{line}: Jinja template {template!r:.60}: {error.message}"
            ) from None


def check_paths(argv: list[str]) -> None:
    """`--include_path` (exists; every task file parses) and `--output_path` (writable),
    as lm-eval reads them from `argv`."""
    flags = _flags(argv)
    if flags.include_path:
        root = Path(flags.include_path)
        if not root.exists():
            raise ConfigError(f"--include_path {flags.include_path}: no such file or folder")
        files = [root] if root.is_file() else sorted(root.glob("**/*.yaml"))
        for path in files:
            check_task_file(path)
    if flags.output_path:
        # lm-eval writes OUTPUT.json beside itself, or a folder of results under OUTPUT.
        path = Path(flags.output_path).absolute()
        folder = path.parent if path.suffix == ".json" else path
        try:
            check_writable(folder)
        except CheckpointError as error:
            raise ConfigError(f"--output_path {flags.output_path}: {error}") from None
