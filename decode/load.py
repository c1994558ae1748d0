"""`python -m decode.load`: the command lives in decode/cli/load.py."""
from decode.cli.load import main

if __name__ == "__main__":
    main()
