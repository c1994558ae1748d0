"""`python -m decode.profile_start`: the command lives in decode/cli/profile_start.py."""
from decode.cli.profile_start import main

if __name__ == "__main__":
    main()
