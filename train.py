#!/usr/bin/env python
"""`python train.py ARGS` runs `imgcls train ARGS` (imgcls/cli/train.py) from a checkout."""
from imgcls.cli import run_main
from imgcls.cli.train import main

if __name__ == "__main__":
    run_main(main)
