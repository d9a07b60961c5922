"""The runtime's errors that more than one module raises."""


class ConfigError(ValueError):
    """A generation option (or a request built from options) outside its valid range."""
