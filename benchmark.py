#!/usr/bin/env python
"""`python benchmark.py ARGS` runs `imgcls benchmark ARGS` (imgcls/cli/benchmark.py) from a checkout."""
from imgcls.cli import run_main
from imgcls.cli.benchmark import main

if __name__ == "__main__":
    run_main(main)
