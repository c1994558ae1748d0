"""One generate or stream call's settings, spelled as transformers spells them, resolved into what a decoder runs;
and the stream a call returns.

    decoder.generate(prompt, max_new_tokens=64)                              # greedy
    decoder.generate(prompt, GenerationConfig(do_sample=True, top_k=50))     # transformers' config object
    decoder.generate(prompt, temperature=0.8, top_p=0.95, seed=1)            # sampling: a temperature above 0 samples
    decoder.generate(prompt, eos_token_id=[0, 198], stop_strings=["\\ndef "])

As in transformers: `do_sample=False` is greedy whatever the temperature; a GenerationConfig brings its own defaults
(top_k 50, temperature 1); the output stops after an end-of-text token or after the token that completes a stop
string, and keeps it. Without a seed each sampled call draws fresh randomness; with one it is reproducible.
"""
import secrets
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any

from decode.errors import InputError
from decode.options import check_number
from decode.sampling import Sampling

SETTINGS = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "eos_token_id", "stop_strings", "seed")
DEFAULT_MAX_NEW_TOKENS = 128
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes


@dataclass(frozen=True)
class Request:
    """What one call decodes: its length, its sampling, its seed, and when it stops early."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    sampling: Sampling = Sampling()
    seed: int = 0
    eos_ids: frozenset[int] = frozenset()  # tokens that end the output (kept), besides the models' end-of-text
    stop_strings: tuple[str, ...] = ()  # texts that end the output once a token completes one (kept)

    def __post_init__(self):
        check_number("seed", self.seed, integer=True)
        if not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise InputError(f"seed must lie in {SEED_RANGE[0]}..{SEED_RANGE[1]} (got {self.seed})", "seed")

    def stop_at(self, tokens: list[int], checked: int, text_of: Callable[[list[int]], str]) -> int | None:
        """How many of `tokens` to keep when a stop condition holds among those after the first `checked`, else None."""
        for i in range(checked, len(tokens)):
            if tokens[i] in self.eos_ids:
                return i + 1
        if self.stop_strings and any(s in text_of(tokens) for s in self.stop_strings):
            for k in range(max(checked, 1), len(tokens) + 1):  # the first token that completes one
                if any(s in text_of(tokens[:k]) for s in self.stop_strings):
                    return k
        return None


def request_of(generation_config, settings: dict | None, check: Callable[[float, int, float], Sampling]) -> Request:
    """A Request from a transformers GenerationConfig (or any object with those attributes) and keyword settings,
    the keywords winning; `check(temperature, top_k, top_p)` makes the Sampling. Unknown settings are InputErrors."""
    settings = dict(settings or {})
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise InputError(f"unknown generation settings {unknown}; this decoder takes {', '.join(SETTINGS)}")
    values: dict[str, Any] = {}
    if generation_config is not None:
        values = {name: getattr(generation_config, name, None) for name in SETTINGS}
        values = {name: value for name, value in values.items() if value is not None}
    values.update({name: value for name, value in settings.items() if value is not None})
    do_sample = values.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise InputError(f"do_sample must be True or False (got {do_sample!r})")
    if do_sample is None:  # this decoder's own convention: a temperature above 0 samples
        do_sample = values.get("temperature", 0.0) > 0 if _number(values.get("temperature", 0.0)) else True
    checked = check(values.get("temperature", 1.0 if do_sample else 0.0), values.get("top_k", 0), values.get("top_p", 1.0))
    sampling = checked if do_sample else Sampling()  # greedy, the settings checked all the same
    seed = values.get("seed")
    eos = values.get("eos_token_id", ())
    eos = (eos,) if isinstance(eos, int) and not isinstance(eos, bool) else eos
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in eos):
        raise InputError(f"eos_token_id must be a token id or a list of them (got {values.get('eos_token_id')!r})")
    given_stops = values.get("stop_strings", ())
    stops = (given_stops,) if isinstance(given_stops, str) else tuple(given_stops) if isinstance(given_stops, (list, tuple)) else (None,)
    if not all(isinstance(s, str) and s for s in stops):
        raise InputError(f"stop_strings must be a non-empty string or a list of them (got {values.get('stop_strings')!r})")
    return Request(values.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS), sampling,
                   secrets.randbits(63) if seed is None else seed, frozenset(eos), stops)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Stream(Iterator[str]):
    """A completion's text in pieces as the oracle accepts tokens; `result` holds the Result once the last piece is
    out (tokens, oracle calls, seconds). `close()` stops decoding and frees the decoder."""

    def __init__(self, pieces: Generator[str, None, object]):
        self.pieces, self.result = pieces, None

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> str:
        try:
            return next(self.pieces)
        except StopIteration as done:
            self.result = done.value
            raise

    def close(self) -> None:
        self.pieces.close()
