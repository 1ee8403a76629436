"""`python -m app [flags]` is `recur serve [flags]`."""

import sys

from app.cli import main

sys.exit(main(["serve", *sys.argv[1:]]))
