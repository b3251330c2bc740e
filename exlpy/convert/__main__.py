"""`python -m exlpy.convert`: the EXL2 converter's command line."""

import sys

from exlpy.convert.args import main

sys.exit(main())
