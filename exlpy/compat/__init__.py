"""Running code written for exllamav2 on exlpy.

`exlpy.compat.install()` makes `import exllamav2` and every `exllamav2.X` submodule resolve to exlpy's module
of the same name, so scripts and libraries that import exllamav2 by name (lm-format-enforcer's and formatron's
integrations, TabbyAPI's backend) run on exlpy without edits. From the shell, `exlpy-as-exllamav2 script.py
[args]` (or `python -m exlpy.compat script.py`) runs a script with the switch installed.
"""

from exlpy.compat.alias import install, installed, uninstall

__all__ = ["install", "installed", "uninstall"]
