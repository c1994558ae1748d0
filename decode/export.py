"""`python -m decode.export`: the command lives in decode/cli/export.py."""
from decode.cli.export import main

if __name__ == "__main__":
    main()
