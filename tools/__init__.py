"""Scripts a maintainer runs from the repository root, each as ``python -m tools.NAME``: benchmarks, the demo, model
fetchers. Not library code: the package ``specdeploy`` never imports them."""
