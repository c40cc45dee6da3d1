"""The version of slimtorch, on its own so that any layer can name it."""

__version__ = "0.1.0"
