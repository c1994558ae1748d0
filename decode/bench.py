"""`python -m decode.bench`: the command lives in decode/cli/bench.py."""
from decode.cli.bench import main

if __name__ == "__main__":
    main()
