"""The complete default configuration: every key jaxmoe knows, with its default, generated
from the section schemas (schema.py lists where each lives, with its one-line docs).

`configs/default.py` (the default main job) and the converters start from `base_config()`,
so the installed package never needs the repository's `configs/` directory at run time.
"""

from ml_collections import ConfigDict

from jaxmoe.config.schema import JobConfig, leaf_fields
from jaxmoe.errors import ConfigError
from jaxmoe.fields import value_type


def base_config() -> ConfigDict:
    """Every config key with its default value (`python -m jaxmoe.config` lists their docs)."""
    return ConfigDict(JobConfig().to_dict())


def complete(config: ConfigDict) -> ConfigDict:
    """`config` with every schema key it lacks added at its default, and ints in float keys
    made floats (a file that built its own ConfigDict wrote `= 1`), in place."""
    defaults = base_config()
    with config.unlocked():
        for key, f in leaf_fields().items():
            *parents, leaf = key.split(".")
            node, default = config, defaults
            for part in parents:
                default = default[part]
                if part not in node:
                    node[part] = ConfigDict()
                node = node[part]
                if not isinstance(node, ConfigDict):
                    raise ConfigError(f"{key.rpartition('.')[0]}={node!r}: expected a section")
            if leaf not in node:
                node[leaf] = default[leaf]
            elif value_type(f) is float and type(node[leaf]) is int:
                value = float(node[leaf])
                del node[leaf]  # a ConfigDict keeps a field's first type: replace the field
                node[leaf] = value
    return config
