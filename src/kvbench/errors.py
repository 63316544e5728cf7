"""Errors kvbench raises for the user: one line, naming the key, the value and what is allowed."""


class ConfigError(ValueError):
    """A configuration value is invalid. Raised before any model loads."""


class DatasetLoadError(RuntimeError):
    """A dataset could not be loaded. The message names the dataset; there is no fallback."""


class IllegalStack(ConfigError):
    """A combination of techniques the capability flags make meaningless (a sweep drops it)."""
