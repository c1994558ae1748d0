"""`python -m decode.shaped`: the command lives in decode/cli/shaped.py."""
from decode.cli.shaped import main

if __name__ == "__main__":
    main()
