"""`python -m exlpy` runs the command line."""

import sys

from exlpy.cli.main import main

sys.exit(main())
