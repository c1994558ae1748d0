"""`python -m decode.report`: the command lives in decode/cli/report.py."""
from decode.cli.report import main

if __name__ == "__main__":
    main()
