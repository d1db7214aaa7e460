"""`python -m imgcls COMMAND [ARGS ...]`, the same as the `imgcls` command."""
from imgcls.cli import main

if __name__ == "__main__":
    main()
