"""A run's tokenizer, from its directory or the hub, checked to be one that decoding can use."""
import functools
import json
from pathlib import Path

from decode.errors import InputError, first_line
from decode.hub import is_hub_name

PROBE = "def f(x):\n    return x\n"  # text every usable code tokenizer turns into tokens


def load_tokenizer(name_or_path):
    """Load a tokenizer from a directory or the hub, with a one-line error when that fails. Loaded once per
    directory and content: a decoder's models, and the checks between them, read the same files (treat it as
    read-only)."""
    path = Path(str(name_or_path))
    files = sorted(f for f in path.iterdir() if f.is_file()) if path.is_dir() else []
    return _load_tokenizer(str(name_or_path), tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in files))


GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")  # tokenizer.json as it is, in transformers 5 and 4


def saved_class(name_or_path: str) -> str | None:
    """The tokenizer class a directory's tokenizer_config.json names (None: no such file, or a hub name)."""
    try:
        return json.loads((Path(name_or_path) / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


@functools.lru_cache(maxsize=16)
def _load_tokenizer(name_or_path: str, contents: tuple):
    try:
        # a tokenizer saved as the generic kind (data.prepare's) is read as saved: transformers' AutoTokenizer would
        # read it as the config's model type's own class (a Qwen2 model's: Qwen2Tokenizer), which splits text otherwise.
        # AutoTokenizer is imported only when needed: importing it indexes every model transformers holds.
        if saved_class(name_or_path) in GENERIC_CLASSES:
            from transformers import PreTrainedTokenizerFast
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(name_or_path))
        else:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(str(name_or_path))
    except Exception as err:  # hub or file errors of many kinds
        hint = "pass a directory written by `python -m data.prepare`, or a hub name when online"
        exists = Path(str(name_or_path)).exists()
        if not exists and not is_hub_name(name_or_path):
            raise InputError(f"tokenizer directory '{name_or_path}' does not exist; {hint}") from None
        where = "directory" if exists else "hub name"
        raise InputError(f"cannot load the tokenizer from {where} '{name_or_path}' ({first_line(err)}); {hint}") from None
    if tokenizer.eos_token_id is None:
        raise InputError(f"tokenizer '{name_or_path}' has no end-of-text token; documents could not be separated")
    if not tokenizer(PROBE, add_special_tokens=False).input_ids:  # a directory without its tokenizer files can load
        raise InputError(f"the tokenizer in '{name_or_path}' turns text into no tokens: its tokenizer files "
                         f"(tokenizer.json or vocab.json and merges.txt) are missing or empty; copy them from the run's "
                         f"tokenizer/ directory")
    tokenizer.clean_up_tokenization_spaces = False
    return tokenizer


def start_ids(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts before a text (Llama 3's <|begin_of_text|>; none for GPT-2's)."""
    plain, full = tokenizer(PROBE, add_special_tokens=False).input_ids, tokenizer(PROBE).input_ids
    return next((full[:i] for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), [])


def text_ids(tokenizer, text: str, start: list[int]) -> list[int]:
    """A prompt's token ids by the tokenizer's own rule: the start tokens it puts before a text (`start`, from
    start_ids) and the text's tokens, unless the text already begins with them (a prompt that writes its
    <|begin_of_text|>). Nothing is added after the text: a prompt is continued, not ended."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return ids if not ids or ids[: len(start)] == start else start + ids


def stop_ids(model_dir, tokenizer) -> frozenset[int]:
    """The tokens that end an output, as transformers' generate stops: the tokenizer's end-of-text and every
    eos_token_id of the model's generation_config.json (Llama 3 lists <|end_of_text|>, <|eom_id|> and <|eot_id|>)."""
    from transformers import GenerationConfig

    try:
        ends = GenerationConfig.from_pretrained(str(model_dir)).eos_token_id
    except OSError:  # no generation_config.json
        ends = None
    ends = [] if ends is None else [ends] if isinstance(ends, int) else list(ends)
    return frozenset([tokenizer.eos_token_id, *ends])
