"""The runtime's errors that more than one module raises."""


class ConfigError(ValueError):
    """A generation option (or a request built from options) outside its valid range."""


class ConcurrentUseError(RuntimeError):
    """A ``Generation`` used from a second thread while another is inside it: one batch is moved by one thread at a
    time (a ``Pipeline`` may be shared; each thread its own ``Generation``)."""
