"""`python -m decode.run`: the command lives in decode/cli/run.py."""
from decode.cli.run import main

if __name__ == "__main__":
    main()
