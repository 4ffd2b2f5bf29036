"""`python -m freetx` is the `freetx` command."""

import sys

from freetx.cli.main import main

sys.exit(main())
