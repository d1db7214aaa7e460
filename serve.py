#!/usr/bin/env python
"""`python serve.py ARGS` runs `imgcls serve ARGS` (imgcls/cli/serve.py) from a checkout."""
from imgcls.cli import run_main
from imgcls.cli.serve import main

if __name__ == "__main__":
    run_main(main)
