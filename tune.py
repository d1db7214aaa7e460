#!/usr/bin/env python
"""`python tune.py ARGS` runs `imgcls tune ARGS` (imgcls/cli/tune.py) from a checkout."""
from imgcls.cli import run_main
from imgcls.cli.tune import main

if __name__ == "__main__":
    run_main(main)
