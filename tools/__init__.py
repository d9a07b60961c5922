"""Maintainer scripts (benchmarks, the demo, fetchers): run as ``python -m tools.NAME`` or ``python tools/NAME.py``."""
