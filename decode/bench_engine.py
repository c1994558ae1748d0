"""`python -m decode.bench_engine`: the command lives in decode/cli/bench_engine.py."""
from decode.cli.bench_engine import main

if __name__ == "__main__":
    main()
