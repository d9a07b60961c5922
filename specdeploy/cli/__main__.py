"""``python -m specdeploy.cli``."""

from . import main

main()
