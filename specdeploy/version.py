"""The package version, in a module of its own: the CLI and the exporter read it without loading the package."""

__version__ = "0.4.0"
