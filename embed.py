#!/usr/bin/env python
"""`python embed.py ARGS` runs `imgcls embed ARGS` (imgcls/cli/embed.py) from a checkout."""
from imgcls.cli import run_main
from imgcls.cli.embed import main

if __name__ == "__main__":
    run_main(main)
