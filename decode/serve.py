"""`python -m decode.serve`: the command lives in decode/cli/serve.py."""
from decode.cli.serve import main

if __name__ == "__main__":
    main()
