"""exlpy's own release (pyproject.toml reads it). Under the exllamav2 alias, `exllamav2.version` is
exlpy/compat/version.py instead: the exllamav2 release whose API exlpy implements."""

__version__ = "0.1.0"
