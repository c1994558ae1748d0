"""`python -m decode.calibrate`: the command lives in decode/cli/calibrate.py."""
from decode.cli.calibrate import main

if __name__ == "__main__":
    main()
