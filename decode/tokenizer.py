"""A run's tokenizer, from its directory or the hub, checked to be one that decoding can use."""
from pathlib import Path

from decode.errors import InputError, first_line

PROBE = "def f(x):\n    return x\n"  # text every usable code tokenizer turns into tokens


def load_tokenizer(name_or_path):
    """Load a tokenizer from a directory or the hub, with a one-line error when that fails."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(name_or_path))
    except Exception as err:  # hub or file errors of many kinds
        where = "directory" if Path(str(name_or_path)).exists() else "hub name"
        reason = first_line(err)
        raise InputError(
            f"cannot load the tokenizer from {where} '{name_or_path}' ({reason}); pass a directory written "
            f"by `python -m data.prepare`, or a hub name when online"
        ) from None
    if tokenizer.eos_token_id is None:
        raise InputError(f"tokenizer '{name_or_path}' has no end-of-text token; documents could not be separated")
    if not tokenizer(PROBE, add_special_tokens=False).input_ids:  # a directory without its tokenizer files can load
        raise InputError(f"the tokenizer in '{name_or_path}' turns text into no tokens: its tokenizer files "
                         f"(tokenizer.json or vocab.json and merges.txt) are missing or empty; copy them from the run's "
                         f"tokenizer/ directory")
    tokenizer.clean_up_tokenization_spaces = False
    return tokenizer
