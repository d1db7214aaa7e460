#!/usr/bin/env python
"""`python export.py ARGS` runs `imgcls export ARGS` (imgcls/cli/export.py) from a checkout."""
from imgcls.cli import run_main
from imgcls.cli.export import main

if __name__ == "__main__":
    run_main(main)
