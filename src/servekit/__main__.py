"""``python -m servekit``: the same command line as ``servekit``."""

from .cli import main

main()
