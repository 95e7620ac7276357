"""Config files are checked like the command line: a key the file sets that no code reads, a
file that is not a config, and a derived key set on the command line each fail at load time
in one line naming the file (and the key). Every shipped config and variant still loads."""

import importlib.util
import re
from pathlib import Path

import pytest

from jaxmoe.cli import main
from jaxmoe.config.loading import load_config
from jaxmoe.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "configs").glob("*.py"))
# configs/uptrain_gqa.py starts from a checkpoint: without one it needs train.init_from.
NEEDS = {"uptrain_gqa.py": ["--config.train.init_from=/checkpoints/converted"]}


def _variants(path: Path) -> tuple[str, ...]:
    spec = importlib.util.spec_from_file_location(f"shipped_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return tuple(getattr(module, "VARIANTS", ()))


@pytest.mark.parametrize(
    "spec",
    [
        f"{path}:{variant}" if variant else str(path)
        for path in SHIPPED
        for variant in ("", *_variants(path))
    ],
    ids=lambda spec: spec.split("configs/")[-1],
)
def test_every_shipped_config_and_variant_loads(spec):
    load_config(spec, NEEDS.get(Path(spec.split(":")[0]).name, []))


def test_configs_with_variants_list_them():
    """The variants a docstring names are the ones tested above (VARIANTS)."""
    for path in SHIPPED:
        if path.name in ("uptrain_gqa.py",):  # its variant is a checkpoint path
            continue
        named = re.search(r"[Vv]ariant", path.read_text().split('"""')[1])
        assert bool(named) == bool(_variants(path)), path.name


def _config_file(tmp_path: Path, body: str, name: str = "bad.py") -> str:
    path = tmp_path / name
    path.write_text(body)
    return str(path)


BASE = "from jaxmoe.config.defaults import base_config\n\n"


@pytest.mark.parametrize(
    "body, message",
    [
        (
            BASE + "def get_config(variant=None):\n    c = base_config()\n"
            "    c.train.stepz = 5\n    return c\n",
            "{path}: unknown config key 'train.stepz' (did you mean 'train.steps'?)",
        ),
        (
            BASE + "def get_config(variant=None):\n    c = base_config()\n"
            "    c.wandb_project = 'x'\n    return c\n",
            "{path}: unknown config key 'wandb_project'",
        ),
        (
            BASE + "def get_config(variant=None):\n    c = base_config()\n"
            "    c.model.moe.topk = 3\n    return c\n",
            "{path}: unknown config key 'model.moe.topk' (did you mean 'model.moe.top_k'?)",
        ),
        (
            "import not_a_module_anywhere\n",
            "--config: {path} failed to load: ModuleNotFoundError: "
            "No module named 'not_a_module_anywhere'",
        ),
        (
            BASE + "def get_config(variant=None):\n    return {}['model']\n",
            "--config: {path}: get_config(None) failed: KeyError: 'model'",
        ),
        (
            BASE + "def get_config(variant=None):\n    c = base_config()\n"
            "    c.train.steps = 'many'\n    return c\n",
            "--config: {path}: get_config(None) failed: TypeError: Could not override field "
            "'steps' (reference). many is of original type <class 'str'> and cannot be "
            "casted to type <class 'int'>",
        ),
        (
            "def get_config(variant=None):\n    raise ValueError('no such size')\n",
            "{path}: no such size",
        ),
        (
            "def get_config(variant=None):\n    return {'train': {'steps': 5}}\n",
            "--config: {path}: get_config() returned a dict, not an ml_collections ConfigDict",
        ),
        ("STEPS = 5\n", "--config: {path} defines no get_config()"),
    ],
    ids=["typo", "top-level", "nested", "import", "raises", "type", "value", "dict", "none"],
)
def test_bad_config_file_is_one_line_naming_it(tmp_path, body, message):
    path = _config_file(tmp_path, body)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value) == message.format(path=path)


def test_yaml_file_is_refused_naming_it(tmp_path):
    path = _config_file(tmp_path, "model:\n  d_model: 128\ntrain:\n  steps: 5\n", name="run.yaml")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value) == (
        f"--config: {path} is not a Python config file (line 1: invalid syntax); "
        "a config defines get_config() returning a ConfigDict"
    )


def test_typo_in_file_is_one_line_from_the_command_line(tmp_path, capsys):
    path = _config_file(
        tmp_path,
        BASE + "def get_config(variant=None):\n    c = base_config()\n"
        "    c.train.stepz = 5\n    return c\n",
    )
    assert main(["train", "--config", path, "--workdir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"jaxmoe train: error: {path}: unknown config key 'train.stepz' "
        "(did you mean 'train.steps'?)\n"
    )
    assert not (tmp_path / "run").exists()


UPTRAIN = str(ROOT / "configs" / "uptrain_gqa.py")
INIT = "--config.train.init_from=/checkpoints/converted"


@pytest.mark.parametrize(
    "override, source",
    [
        ("--config.train.steps=100", "uptrain.alpha"),
        ("--config.optimizer.start_step=7", "uptrain.original_steps"),
        ("--config.optimizer.schedule_steps=900", "uptrain.original_schedule_steps"),
    ],
)
def test_derived_key_set_on_the_command_line_is_refused(override, source):
    key = override.removeprefix("--config.").split("=")[0]
    with pytest.raises(ConfigError) as error:
        load_config(UPTRAIN, [INIT, override])
    assert str(error.value) == (
        f"--config.{key} conflicts with {source}: configs/uptrain_gqa.py derives {key} "
        f"from uptrain.* (set --config.{source} instead)"
    )


def test_derived_keys_follow_uptrain():
    config = load_config(UPTRAIN, [INIT, "--config.uptrain.alpha=0.5"])
    assert config.train.steps == round(0.5 * config.extra["uptrain"]["original_steps"])


def test_any_finalize_replacing_an_override_is_refused(tmp_path):
    """The same for a config file without its own check: finalize must not win silently."""
    path = _config_file(
        tmp_path,
        BASE + "def get_config(variant=None):\n    return base_config()\n\n"
        "def finalize(config, overridden):\n    config.train.steps = 10\n",
    )
    with pytest.raises(ConfigError) as error:
        load_config(path, ["--config.train.steps=100"])
    assert str(error.value) == (
        f"--config.train.steps=100: {path}'s finalize() derives train.steps (it would set "
        "10); set what it derives it from"
    )
    assert load_config(path).train.steps == 10


@pytest.mark.parametrize("command", ["train", "eval", "decode", "analyze-routing", "compile"])
def test_help_shows_config_overrides(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    usage = out.split("\n\n")[0]
    assert "[--config.KEY=VALUE]" in usage
    assert "--config.KEY=VALUE    set any config key, repeatable" in out
