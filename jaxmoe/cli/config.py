"""`jaxmoe config [SECTION|KEY ...] [--config FILE[:variant]]`: every config key with its
type, default and one-line doc, read from the typed schema (jaxmoe/config/schema.py and the
section dataclasses it lists); with `--config`, the values that file (and any
`--config.KEY=VALUE`) sets where they differ from the defaults."""

import argparse
import difflib

from jaxmoe.cli.flags import add_override_flag


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `jaxmoe config` on the CLI's subparsers; it runs `run`."""
    parser = subparsers.add_parser(
        "config",
        help="list every config key: type, default, one-line doc (filter by section)",
        description=(
            "Every key that --config.KEY=VALUE (and a config file) can set, one line each: "
            "`key (type, default): doc [choices]`. Name sections or keys to list only "
            "those (e.g. `jaxmoe config model.moe train.steps`). With --config FILE, keys "
            "that file and the overrides set to something other than the default end in "
            "`= value`, and the file's own keys (its EXTRA_KEYS) follow."
        ),
    )
    parser.add_argument(
        "prefixes",
        nargs="*",
        metavar="SECTION",
        help="a section (model, model.moe, train, optimizer, mesh, data) or a key",
    )
    parser.add_argument(
        "--config", default=None, help="a config file (optionally with :variant) to show"
    )
    add_override_flag(parser)
    parser.set_defaults(run=run)
    return parser


def matching(key: str, prefixes: list[str]) -> bool:
    """`key` is one of `prefixes` or lies in a section one of them names."""
    return not prefixes or any(key == p or key.startswith(p.rstrip(".") + ".") for p in prefixes)


def _flatten(config, prefix: str = "") -> dict:
    out = {}
    for name, value in config.items():
        if hasattr(value, "items"):
            out.update(_flatten(value, f"{prefix}{name}."))
        else:
            out[prefix + name] = value
    return out


def run(args) -> int:
    from jaxmoe.config.schema import describe, leaf_fields
    from jaxmoe.errors import ConfigError

    known = list(leaf_fields())
    sections = sorted({k.rsplit(".", 1)[0] for k in known} | {k.split(".")[0] for k in known})
    values, extra = {}, {}
    if args.config:
        from jaxmoe.config.defaults import base_config
        from jaxmoe.config.loading import load_config

        defaults = _flatten(base_config())
        loaded = load_config(args.config, args.overrides).to_dict()
        for key, value in _flatten(loaded).items():
            if key not in defaults:
                extra[key] = value
            elif value != defaults[key]:
                values[key] = value
    elif args.overrides:
        raise ConfigError("--config.KEY=VALUE needs --config FILE (the file they change)")
    for prefix in args.prefixes:
        if not any(matching(k, [prefix]) for k in [*known, *extra]):
            close = difflib.get_close_matches(prefix, [*sections, *known, *extra], n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"no config key is or lies in {prefix!r} ({hint}sections: {', '.join(sections)})"
            )
    for line in describe():
        key = line.split(" ", 1)[0]
        if matching(key, args.prefixes):
            print(line + (f" = {values[key]!r}" if key in values else ""))
    for key, value in extra.items():
        if matching(key, args.prefixes):
            print(f"{key} = {value!r} ({args.config.partition(':')[0]}'s own key)")
    return 0
