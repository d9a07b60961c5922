"""The speculative runtime: pure NumPy over engines. Imports neither torch nor transformers."""
