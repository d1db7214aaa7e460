#!/usr/bin/env python
"""`python infer.py ARGS` runs `imgcls infer ARGS` (imgcls/cli/infer.py) from a checkout."""
from imgcls.cli import run_main
from imgcls.cli.infer import main

if __name__ == "__main__":
    run_main(main)
