"""The commands: `python -m decode.NAME` runs decode/cli/NAME.py; `flags` holds the decoder flags they share and
`settings` what they read from them alike (prompts, sampling, the decoder)."""
