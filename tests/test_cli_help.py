"""Help that answers: `jaxmoe config` lists every key of the typed schema (type, default,
one-line doc) and filters by section; every command that reads `--config.KEY=VALUE` shows
the flag and points to `jaxmoe config`; `convert hf --help` names every family the importer
reads. All in-process: no JAX computation, no subprocess."""

import argparse
import dataclasses

import pytest

from jaxmoe.cli import build_parser, main
from jaxmoe.config.schema import JobConfig

# Commands that read --config.KEY=VALUE overrides (the CLI takes them out of argv for all).
TAKES_OVERRIDES = {
    "train",
    "prepare",
    "eval",
    "decode",
    "compile",
    "analyze-routing",
    "config",
    "convert t5x",
    "convert hf",
}


def leaf_parsers(parser: argparse.ArgumentParser, name: str = "") -> dict:
    """'convert hf' -> its parser, for every command of the CLI."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return {name: parser}
    out = {}
    for command, child in subs[0].choices.items():
        out.update(leaf_parsers(child, f"{name} {command}".strip()))
    return out


def schema_keys(cls=JobConfig, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Every key of the schema, walked here from the dataclasses themselves."""
    out = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type):
            flat = f.metadata.get("flat")  # its keys are written in the parent's namespace
            out.update(schema_keys(f.type, prefix if flat else f"{prefix}{f.name}."))
        elif "doc" in f.metadata:
            out[prefix + f.name] = f
    return out


def config_lines(capsys, *argv: str) -> list[str]:
    assert main(["config", *argv]) == 0
    return capsys.readouterr().out.splitlines()


def test_jaxmoe_config_lists_every_key_with_type_default_and_doc(capsys):
    lines = {line.split(" ", 1)[0]: line for line in config_lines(capsys)}
    keys = schema_keys()
    assert set(lines) == set(keys)
    for key, f in keys.items():
        line = lines[key]
        assert f"{f.default!r}" in line, line
        assert f.metadata["doc"] in line, line
        kind = type(f.default).__name__  # the type a default of the key has
        assert line.startswith(f"{key} ({kind}, "), line


def test_jaxmoe_config_filters_by_section_and_key(capsys):
    moe = config_lines(capsys, "model.moe")
    assert moe and all(line.startswith("model.moe.") for line in moe)
    assert len(moe) == sum(k.startswith("model.moe.") for k in schema_keys())
    two = config_lines(capsys, "train.steps", "mesh")
    assert two[0].split(" ", 1)[0] == "train.steps"
    assert {line.split(" ", 1)[0] for line in two[1:]} == {
        k for k in schema_keys() if k.startswith("mesh.")
    }


def test_jaxmoe_config_shows_what_a_file_and_overrides_set(capsys):
    lines = config_lines(
        capsys, "--config", "configs/default.py:top2", "--config.train.steps=5", "model", "train"
    )
    by_key = {line.split(" ", 1)[0]: line for line in lines}
    assert by_key["model.moe.gating"].endswith("= 'top2'")
    assert by_key["train.steps"].endswith("= 5")
    assert not by_key["train.batch_size"].endswith("= 16")  # at its default: no value shown


def test_jaxmoe_config_names_an_unknown_section(capsys):
    assert main(["config", "modle"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'model'?" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("command", sorted(leaf_parsers(build_parser())))
def test_override_flag_help_points_to_jaxmoe_config(command):
    text = leaf_parsers(build_parser())[command].format_help()
    if command in TAKES_OVERRIDES:
        assert "--config.KEY=VALUE" in text
        assert "jaxmoe config" in " ".join(text.split())
    else:
        assert "--config.KEY=VALUE" not in text


def test_surgery_refuses_overrides_it_would_drop(capsys):
    assert main(["convert", "gqa", "a", "b", "--num_kv_heads", "1", "--config.train.steps=3"]) == 2
    assert "convert gqa takes no --config overrides" in capsys.readouterr().err


def test_convert_hf_help_names_every_family_the_importer_reads():
    from jaxmoe.conversions.choices import HF_FAMILIES
    from jaxmoe.conversions.hf.names import SUPPORTED_MODEL_TYPES

    assert set(HF_FAMILIES) == set(SUPPORTED_MODEL_TYPES)
    text = " ".join(leaf_parsers(build_parser())["convert hf"].format_help().split())
    for model_type, name in HF_FAMILIES.items():
        assert f"{name} ({model_type})" in text
