"""The commands: `python -m decode.NAME` runs decode/cli/NAME.py; `flags` holds the decoder flags they share and
`harness` the timing and the baseline comparison of the tools that measure decoding."""
