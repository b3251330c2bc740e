"""`python -m exlpy.compat SCRIPT [ARGS...]`: see exlpy.compat.run."""

from exlpy.compat.run import main

main()
