"""`python -m decode.quantize`: the command lives in decode/cli/quantize.py."""
from decode.cli.quantize import main

if __name__ == "__main__":
    main()
