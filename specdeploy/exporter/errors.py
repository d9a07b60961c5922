"""The exporter's one error type, in a module of its own: the graph writers, the checkpoint readers and the registry
raise it, and the registry imports the writers."""


class ExportError(ValueError):
    """A checkpoint or option the exporter cannot turn into a verify-v1 artifact."""
