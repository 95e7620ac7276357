"""Errors users see as one line: the CLI prints them as `jaxmoe CMD: error: ...`."""


class ConfigError(ValueError):
    """A bad config value, flag or combination; the message names the key."""


class CheckpointError(ValueError):
    """A checkpoint or conversion source that cannot be used as asked; the message names the
    file, tensor or key (jaxmoe.checkpoints.manager re-exports it, where most code imports it)."""
