"""`python -m aserve` is the `aserve` command."""

import sys

from aserve.cli import main

sys.exit(main())
