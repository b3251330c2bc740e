"""exllamav2's `version` module under the alias: the exllamav2 release whose API exlpy implements.

`import exllamav2; exllamav2.__version__`, `from exllamav2.version import __version__` and the metadata of
the environment-wide alias (`importlib.metadata.version("exllamav2")`) all read this one constant, so a
program checking for a minimum exllamav2 version sees the API level it gets. exlpy's own release number is
`exlpy.version.__version__`.
"""

__version__ = "0.3.2"
