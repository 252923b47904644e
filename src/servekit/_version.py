"""servekit's version, in a module of its own so the protocol layer can report it
without importing the package's public API."""

__version__ = "0.1.0"
