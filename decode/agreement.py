"""`python -m decode.agreement`: the command lives in decode/cli/agreement.py."""
from decode.cli.agreement import main

if __name__ == "__main__":
    main()
