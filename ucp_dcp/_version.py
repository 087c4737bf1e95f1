"""The package version (a module of its own, so planners can record it without importing the package)."""

__version__ = "0.2.0"
