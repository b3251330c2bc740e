"""The package version (exllamav2 scripts import `exllamav2.version.__version__`); pyproject.toml reads it."""

__version__ = "0.1.0"
