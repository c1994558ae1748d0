"""Measuring: a model's forward (forwards), a decoding step's parts (steps), methods decoding in turns (turns), and
keeping what was measured for later runs (kept)."""
