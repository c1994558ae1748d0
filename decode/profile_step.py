"""`python -m decode.profile_step`: the command lives in decode/cli/profile_step.py."""
from decode.cli.profile_step import main

if __name__ == "__main__":
    main()
