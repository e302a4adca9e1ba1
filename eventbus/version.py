"""The eventbus version, in one place: pyproject.toml reads it, log headers write it."""

__all__ = ["__version__"]

__version__ = "0.1.0"
