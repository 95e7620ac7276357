"""Errors users see as one line: the CLI prints them as `jaxmoe CMD: error: ...`."""


class ConfigError(ValueError):
    """A bad config value, flag or combination; the message names the key."""
