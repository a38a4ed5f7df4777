"""The package version, at the bottom so any layer can report it."""

__version__ = "0.1.0"
