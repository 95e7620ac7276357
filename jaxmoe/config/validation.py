"""Config validation: impossible values and combinations, each a one-line ConfigError naming
the keys, before anything is compiled. The checks live with the section schemas (schema.py
lists them); this module runs them on a ConfigDict through `typed`."""

from ml_collections import ConfigDict

from jaxmoe.config.schema import JobConfig, typed


def get(config: ConfigDict, key: str):
    node = config
    for part in key.split("."):
        node = node[part]
    return node


def validate(config: ConfigDict) -> JobConfig:
    """Impossible combinations, each as a one-line ConfigError naming keys and values;
    returns the typed view. Older spellings of a value are rewritten in place first."""
    from jaxmoe.models.stack import remat_name

    if "model" in config and "remat" in config.model:
        config.model.remat = remat_name(config.model.remat)  # true/false of older configs
    return typed(config)
