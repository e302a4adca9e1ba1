"""The installed eventbus version (written into log headers)."""

__all__ = ["__version__"]

__version__ = "0.1.0"
