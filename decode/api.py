"""Staged speculative decoding from Python: build a decoder once, generate or stream many times.

    from decode import SpeculativeDecoder
    dec = SpeculativeDecoder.from_run("runs/default", method="staged", dtype="bfloat16")
    result = dec.generate("def fib(n):", max_new_tokens=64)       # .text, .token_ids, .oracle_calls, .seconds
    for piece in dec.stream("def fib(n):", max_new_tokens=64):    # text as tokens are accepted
        print(piece, end="", flush=True)

Bad settings raise the one-line InputError the command-line tools print.
"""
import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from decode import generation, loop
from decode.drafting import Drafter
from decode.errors import InputError, check_path
from decode.healing import Prompt, TokenHealer
from decode.methods import METHODS, check_options, check_tree_shape
from decode.models.cached_lm import CachedLM
from decode.models.loading import check_same_vocabulary, load_draft, load_model, load_trigram, pretrained_dir
from decode.options import DecoderOptions, check_number, sampling_of
from decode.resolution import Resolved, resolve
from decode.sampling import GREEDY, Sampling
from decode.tokenizer import load_tokenizer, start_ids, stop_ids, text_ids

log = logging.getLogger("decode")


def drain(pieces: Generator[str, None, "Result"], each: Callable[[str], object] = lambda piece: None) -> "Result":
    """Run SpeculativeDecoder.decode to the end, handing each piece of text to `each`; its Result."""
    while True:
        try:
            each(next(pieces))
        except StopIteration as done:
            return done.value


@dataclass
class Result:
    text: str  # the completion: what the new tokens add to the prompt
    token_ids: list[int]  # the new tokens (an end-of-text token included)
    oracle_calls: int
    draft_calls: int
    seconds: float
    healed: str  # the prompt's text that token healing backed off ("" when none)
    finish_reason: str = "length"  # "stop": an end-of-text token or a stop string ended it; "length": max_new_tokens

    @property
    def tokens_per_oracle_call(self) -> float:
        return len(self.token_ids) / self.oracle_calls


class DecoderBusy(RuntimeError):
    """A second generate or stream on a decoder that is still decoding: its models hold one sequence's caches."""


def drafting(options: DecoderOptions) -> tuple:
    """What tells two decoders' drafting apart: the plan and the policy they follow."""
    return options.plan, repr(options.policy)


class SpeculativeDecoder:
    """One method over one set of models; `generate` and `stream` decode a prompt (text or token ids).

    With `plans` (resolved: decode.resolution), a request decodes with the plan made for its sampling setting, or the
    method's default for it (greedy: `options`' own): each setting's drafter is built on first use, over the same
    loaded models.

    One sequence at a time: the models' caches hold the sequence being decoded. A generate or stream that starts
    while another is decoding (another thread's, or an unfinished stream in this one) raises DecoderBusy at once,
    and the decoding in progress goes on unharmed. Use one decoder per thread, or take turns."""

    def __init__(self, options: DecoderOptions, plans: Resolved | None = None):
        self.options = check_options(options)
        self.models: dict = {}  # what build_decoder loaded, shared by every setting's decoder
        self.decoder, self.healer = build_decoder(self.options, self.models)
        self.tokenizer = self.healer.tokenizer
        self.start_ids = start_ids(self.tokenizer)  # what the tokenizer puts before a text prompt
        self.plans = plans
        self.settings: dict[Sampling, DecoderOptions] = {}  # sampling setting -> its options (with `plans`)
        self.decoders = {drafting(self.options): self.decoder}  # what a decoder drafts with -> the decoder
        self.busy = threading.Lock()
        self.materialized: list = []  # temporary directories from_pretrained saved loaded models into

    def options_for(self, sampling: Sampling) -> DecoderOptions:
        """The options a request with this sampling decodes with."""
        if self.plans is None or sampling.greedy:
            return self.options
        if sampling not in self.settings:
            self.settings[sampling] = check_options(self.plans.options(sampling))
            for note in self.plans.notes(sampling):
                log.info(note)
        return self.settings[sampling]

    def decoder_for(self, sampling: Sampling) -> "Decoder":
        """The decoder for this sampling setting, built on first use."""
        options = self.options_for(sampling)
        if drafting(options) not in self.decoders:
            self.decoders[drafting(options)] = build_decoder(options, self.models)[0]
        return self.decoders[drafting(options)]

    @classmethod
    def from_run(cls, run: str | Path | None = None, *, oracle=None, draft=None, ngram=None, **options) -> "SpeculativeDecoder":
        """Models from a run directory (RUN/oracle, RUN/draft, RUN/ngram, and the run's plan for each call's sampling
        setting, RUN/plan.json when greedy: plan=None turns them off, plan=PATH uses that one for every call) or given
        one by one; any other DecoderOptions field (method, dtype, device, budget, widths, ...) as a keyword, which
        wins over the plan's value."""
        if oracle is None and run is None:
            raise InputError("pass a run directory or oracle=DIR")
        names = {f.name for f in fields(DecoderOptions)} - {"policy"}
        unknown = sorted(set(options) - names)
        if unknown:
            raise InputError(f"unknown options {unknown}; choose from {', '.join(sorted(names - {'oracle', 'draft', 'ngram'}))}")
        named = "plan" in options  # plan=None: no plan; plan=PATH: that one for every setting; else the run's own
        plan = options.pop("plan", None)
        resolved = resolve(options | {"oracle": oracle, "draft": draft, "ngram": ngram}, frozenset(options),
                           Path(run) if run else None, plan=Path(plan) if plan else None,
                           plans=not named or plan is not None)
        for note in resolved.notes():
            log.info(note)
        return cls(resolved.options(), resolved)

    @classmethod
    def from_pretrained(cls, oracle, draft=None, ngram=None, *, tokenizer=None, method: str | None = None,
                        **options) -> "SpeculativeDecoder":
        """A decoder as transformers' from_pretrained makes a model: `oracle` and `draft` each a directory, a hub
        name, or a model already loaded (with its `tokenizer`, which both models share); `ngram` a trigram
        directory (python ngram/build_katz.py). The method defaults to staged with all three, speculative with a
        draft, else baseline; every other DecoderOptions field is a keyword (dtype="auto" by default)."""
        if tokenizer is not None and not hasattr(tokenizer, "save_pretrained"):
            raise InputError(f"tokenizer must be a loaded tokenizer (AutoTokenizer.from_pretrained(...)), the one of "
                             f"models handed over loaded (got {tokenizer!r})", "tokenizer")
        keep: list = []  # temporary directories of models handed over loaded, kept as long as the decoder
        oracle_dir = pretrained_dir(oracle, tokenizer, keep, "oracle")
        draft_dir = draft if draft is None else pretrained_dir(draft, tokenizer, keep, "draft")
        method = method or ("staged" if draft is not None and ngram is not None else
                            "speculative" if draft is not None else "baseline")
        decoder = cls.from_run(oracle=oracle_dir, draft=draft_dir, ngram=ngram, method=method, **options)
        decoder.materialized = keep
        return decoder

    def prompt(self, prompt: str | list[int], max_new_tokens: int, lookahead: int | None = None) -> Prompt:
        """The prompt as the models will see it (healed), checked against the context (`room`)."""
        if isinstance(prompt, str):
            ids = self.token_ids(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            if any(not 0 <= t < self.decoder.oracle.vocab_size for t in ids):
                raise InputError(f"prompt token ids must lie in 0..{self.decoder.oracle.vocab_size - 1}")
        else:
            raise InputError(f"a prompt is a string or a list of token ids (got {type(prompt).__name__})")
        return self.encode(ids, "prompt", max_new_tokens, lookahead)

    def token_ids(self, text: str, name: str = "prompt") -> list[int]:
        """A prompt's text as the tokenizer splits it, after the start tokens it adds (decode.tokenizer.text_ids),
        the same for the command line, this API and the server's text prompts; InputError for text that is not
        Unicode (a lone surrogate, as undecodable command-line bytes or a JSON escape can make)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise InputError(f"{name} holds a lone surrogate (U+{ord(text[err.start]):04X} at character {err.start}), "
                             f"which is not text; pass valid Unicode", "prompt") from None
        return text_ids(self.tokenizer, text, self.start_ids)

    def lookahead(self, sampling: Sampling = GREEDY) -> int:
        """Positions past the output a step may score when decoding with this sampling setting (its drafted depth)."""
        options = self.options_for(sampling)
        return METHODS[options.method].lookahead(options)

    def room(self, prompt_tokens: int, lookahead: int | None = None) -> int:
        """How many tokens a prompt of `prompt_tokens` tokens leaves to generate in the models' context: the drafts'
        lookahead (default: greedy decoding's) and the token healing's back-off take their share."""
        return self.decoder.context() - prompt_tokens - (self.decoder.lookahead() if lookahead is None else lookahead) - 1

    def encode(self, ids: list[int], name: str, max_new_tokens: int, lookahead: int | None = None) -> Prompt:
        check_number("max_new_tokens", max_new_tokens, integer=True)
        if max_new_tokens < 1:
            raise InputError(f"--max-new-tokens must be at least 1 (got {max_new_tokens})")
        if not ids:
            raise InputError(f"prompt {name!r} is empty; give some text to continue")
        context, room = self.decoder.context(), self.room(len(ids), lookahead)
        if room < 1:
            raise InputError(f"prompt {name!r} has {len(ids)} tokens; the models' context of {context} leaves no room to generate")
        if max_new_tokens > room:
            raise InputError(f"--max-new-tokens {max_new_tokens} does not fit the context of {context} after "
                             f"prompt {name!r} ({len(ids)} tokens); use at most {room}")
        return self.healer(ids, self.options.device)

    def generate(self, prompt: str | list[int], generation_config=None, *, streamer=None, **settings) -> Result:
        """Decode one prompt (text or token ids); greedy output is the oracle's, token for token. The settings are
        transformers' (decode.generation): a GenerationConfig and/or max_new_tokens, do_sample, temperature, top_k,
        top_p, eos_token_id, stop_strings, seed. A transformers streamer (TextStreamer, TextIteratorStreamer) gets
        the prompt's ids, then the new tokens as the oracle accepts them, then its end."""
        request = generation.request_of(generation_config, settings, sampling_of)
        return drain(self.decoding(prompt, request, pieces=False, streamer=streamer))

    def stream(self, prompt: str | list[int], generation_config=None, **settings) -> generation.Stream:
        """The completion's text in pieces, as the oracle accepts tokens; they join to `generate`'s text, and the
        stream's `result` is generate's Result once the last piece is out. The settings are generate's."""
        return generation.Stream(self.decoding(prompt, generation.request_of(generation_config, settings, sampling_of),
                                               pieces=True))

    def decoding(self, prompt, request: generation.Request, pieces: bool, streamer=None) -> Generator[str, None, Result]:
        """`decode` with the prompt checked, holding the decoder from its first step to its last (or until the
        generator is closed): a second decoding meanwhile raises DecoderBusy."""
        if not self.busy.acquire(blocking=False):
            raise DecoderBusy("this decoder is already decoding another prompt (another thread's call, or a stream "
                              "not yet finished or closed); decode one prompt at a time on it, or use one decoder per thread")
        try:
            encoded = self.prompt(prompt, request.max_new_tokens, self.lookahead(request.sampling))
            return (yield from self.decode(encoded, request, pieces, streamer))
        finally:
            self.busy.release()

    def decode(self, prompt: Prompt, request: generation.Request, pieces: bool, streamer=None
               ) -> Generator[str, None, Result]:
        """Decode an encoded prompt as the request says; with `pieces`, yield the new text
        after each oracle call. A piece never ends inside a character: an incomplete UTF-8 sequence (decoded as
        U+FFFD) waits for its rest. The output ends at the request's stop conditions. Returns the Result."""
        text_of = lambda tokens: prompt.completion(self.tokenizer, tokens, self.decoder.stop_ids)
        start, sent, seen, stopped = time.perf_counter(), 0, 0, None
        checks = bool(request.eos_ids or request.stop_strings)
        if streamer is not None:
            streamer.put(prompt.ids.detach().cpu())
        for out in self.decoder_for(request.sampling).steps(prompt, request.max_new_tokens, request.seed, request.sampling):
            stopped = request.stop_at(out.tokens, seen, text_of) if checks else None
            tokens = out.tokens if stopped is None else out.tokens[:stopped]  # the loop's own list, grown each step
            if streamer is not None and len(tokens) > seen:
                streamer.put(torch.tensor(tokens[seen:]))
            seen = len(tokens)
            if pieces:
                text = text_of(tokens)
                end = len(text.rstrip("\ufffd"))
                if end > sent:
                    yield text[sent:end]
                    sent = end
            if stopped is not None:
                break
        done = stopped is not None or (tokens and tokens[-1] in self.decoder.stop_ids)
        result = Result(text_of(tokens), tokens, out.oracle_calls, out.draft_calls, time.perf_counter() - start,
                        prompt.tail, "stop" if done else "length")
        if pieces and len(result.text) > sent:  # the output ended inside a character, as generate's text does
            yield result.text[sent:]
        if streamer is not None:
            streamer.end()
        return result




@dataclass
class Decoder:
    """A method's models and drafter: everything it needs to decode one prompt."""

    options: DecoderOptions
    oracle: CachedLM
    draft: CachedLM | None
    drafter: Drafter | None
    eos_id: int  # the tokenizer's end-of-text, which separates the documents the trigram counted
    stop_ids: frozenset[int]  # the tokens that end an output: eos_id and the model's generation_config.json's

    def steps(self, prompt: Prompt, max_new_tokens: int, seed: int, sampling: Sampling, verify: Callable | None = None,
              hooks: loop.Hooks = loop.UNTIMED) -> Iterator[loop.Generation]:
        """The generation so far after each oracle call. `verify`: a speculative method's verification rule in
        place of its own (decode.cli.agreement passes one that records what the oracle's forwards computed);
        `hooks` hear the time each part of a step takes."""
        generator = torch.Generator(self.oracle.device).manual_seed(seed)  # torch samples with a generator on the tensors' device
        args = (self.oracle, prompt.ids, max_new_tokens, sampling, self.stop_ids)
        if self.drafter is None:
            return loop.baseline_steps(*args, generator=generator, allowed=prompt.allowed, hooks=hooks)
        return loop.tree_speculative_steps(*args, drafter=self.drafter, generator=generator, allowed=prompt.allowed,
                                           verify=verify, hooks=hooks)

    def __call__(self, prompt: Prompt, max_new_tokens: int, seed: int, sampling: Sampling,
                 hooks: loop.Hooks = loop.UNTIMED) -> loop.Generation:
        return loop.run_to_end(self.steps(prompt, max_new_tokens, seed, sampling, hooks=hooks))

    def context(self) -> int:
        return min(m.max_length for m in (self.oracle, self.draft) if m is not None)

    def lookahead(self) -> int:
        """Positions past the output a step may score: the drafted depth."""
        return METHODS[self.options.method].lookahead(self.options)


def loaded(models: dict, key: tuple, load: Callable):
    """models[key], loaded first if it is not there."""
    if key not in models:
        models[key] = load()
    return models[key]


def require_draft(draft, needed_by: str) -> Path:
    """The draft directory, refused where a method that drafts with a draft model (`needed_by` names it) has none."""
    if draft is None:
        raise InputError(f"{needed_by} needs a draft model; pass --draft DIR (or --run RUN)")
    check_path(draft, True, "draft directory", "pass --draft DIR (or --run RUN)")
    return Path(draft)


def build_decoder(options: DecoderOptions, models: dict | None = None) -> tuple[Decoder, TokenHealer]:
    """The method's decoder, and the healer that turns prompt token ids into its prompts (its tokenizer: .tokenizer).
    `models` holds what earlier decoders loaded (the oracle, the draft, the trigram), to be shared with this one: a
    sequence resets the models' caches as it starts."""
    models = {} if models is None else models
    check_path(options.oracle, True, "oracle directory", "train one with train/finetune_oracle.py, or pass --oracle DIR")
    method = METHODS[options.method]
    how = (options.oracle, options.backend, options.dtype, options.device, options.cuda_graphs)  # load_model's arguments
    oracle = loaded(models, ("oracle", *how), lambda: load_model(*how))
    tokenizer = load_tokenizer(options.oracle)
    draft = table = drafter = None
    if method.draft:
        check_same_vocabulary(options.oracle, require_draft(options.draft, f"--method {options.method}"), "draft")
        draft = loaded(models, ("draft", options.draft, options.backend, options.draft_dtype or options.dtype, options.device,
                                options.cuda_graphs, options.draft_vocab), lambda: load_draft(options, oracle.vocab_size))
        if draft.vocab_size != oracle.vocab_size:
            raise InputError(f"the oracle has {oracle.vocab_size} output tokens and the draft {draft.vocab_size}; they must match")
    if method.trigram:
        table = loaded(models, ("ngram", options.ngram), lambda: load_trigram(options, len(tokenizer), tokenizer.eos_token_id))
    if method.tree:
        check_tree_shape(options, table)
    if method.drafter is not None:
        drafter = method.drafter(options, draft, table)
    decoder = Decoder(options, oracle, draft, drafter, tokenizer.eos_token_id, stop_ids(options.oracle, tokenizer))
    check_lookahead(decoder)
    return decoder, TokenHealer(tokenizer, oracle.vocab_size, options.token_healing)


def check_lookahead(decoder: Decoder) -> None:
    """Refuse, naming the setting, a draft deeper than the models' context leaves room for (a prompt of one token,
    its healing's back-off and one new token)."""
    largest = decoder.context() - 3
    if decoder.lookahead() > largest:
        setting = METHODS[decoder.options.method].lookahead_setting
        raise InputError(f"--{setting.replace('_', '-')} {getattr(decoder.options, setting)} drafts past the models' "
                         f"context of {decoder.context()} tokens; use at most {largest}", setting)
