#!/usr/bin/env python
"""`python search.py ARGS` runs `imgcls search ARGS` (imgcls/cli/search.py) from a checkout."""
from imgcls.cli import run_main
from imgcls.cli.search import main

if __name__ == "__main__":
    run_main(main)
