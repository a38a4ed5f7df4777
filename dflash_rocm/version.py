"""The package version, at the bottom so any layer can report it."""

__version__ = "0.2.0"
