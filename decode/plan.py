"""`python -m decode.plan`: the command lives in decode/cli/plan.py."""
from decode.cli.plan import main

if __name__ == "__main__":
    main()
