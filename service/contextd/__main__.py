"""`python -m contextd` is the `contextd` command."""

import sys

from contextd.cli import main

sys.exit(main())
