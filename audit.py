#!/usr/bin/env python
"""`python audit.py ARGS` runs `imgcls audit ARGS` (imgcls/cli/audit.py) from a checkout."""
from imgcls.cli import run_main
from imgcls.cli.audit import main

if __name__ == "__main__":
    run_main(main)
