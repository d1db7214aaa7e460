#!/usr/bin/env python
"""`python eval.py ARGS` runs `imgcls eval ARGS` (imgcls/cli/eval.py) from a checkout."""
from imgcls.cli import run_main
from imgcls.cli.eval import main

if __name__ == "__main__":
    run_main(main)
