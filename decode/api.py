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
from collections.abc import Callable, Generator
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from decode import generation, loop
from decode.batch import Batch
from decode.completion_text import CompletionText
from decode.decoder import Decoder, build_decoder
from decode.errors import InputError
from decode.healing import Prompt
from decode.methods import METHODS, check_options
from decode.models.loading import pretrained_dir
from decode.options import DecoderOptions, check_number, sampling_of
from decode.resolution import Resolved, resolve
from decode.sampling import GREEDY, Sampling
from decode.tokenizer import start_ids, text_ids

log = logging.getLogger("decode")


def drain_one(pieces: Generator[str, None, "Result"]) -> "Result | None":
    """The next piece of SpeculativeDecoder.decode read and dropped: its Result once it has ended, else None."""
    try:
        next(pieces)
    except StopIteration as done:
        return done.value
    return None


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

    One call at a time: the models' caches hold the sequence being decoded. A generate, stream or generate_batch
    that starts while another is decoding (another thread's, or an unfinished stream in this one) raises DecoderBusy
    at once, and the decoding in progress goes on unharmed. Use one decoder per thread, or take turns; several
    prompts decode together in generate_batch, or in stream_in over a batch of one thread's streams."""

    def __init__(self, options: DecoderOptions, plans: Resolved | None = None):
        self.options = check_options(options)
        self.models: dict = {}  # what build_decoder loaded, shared by every setting's decoder
        self.decoder, self.healer = build_decoder(self.options, self.models)
        self.tokenizer = self.healer.tokenizer
        self.start_ids = start_ids(self.tokenizer)  # what the tokenizer puts before a text prompt
        self.plans = plans
        self.settings: dict[tuple[Sampling, int], DecoderOptions] = {}  # (sampling, load) -> its options (`plans`)
        self.decoders = {drafting(self.options): self.decoder}  # what a decoder drafts with -> the decoder
        self.busy = threading.Lock()
        self.batch = Batch()  # generate_batch's sequences, its forks of the decoders kept from one call to the next
        self.materialized: list = []  # temporary directories from_pretrained saved loaded models into

    def options_for(self, sampling: Sampling, in_flight: int = 1) -> DecoderOptions:
        """The options a request with this sampling decodes with, beside `in_flight` - 1 others: greedy, its plan's
        policy for that load where the plan has one (decode.plan --concurrency); sampled, its setting's at any load,
        so that its seed gives one output alone or beside others."""
        load = in_flight if sampling.greedy else 1
        if self.plans is None or (sampling.greedy and load == 1):
            return self.options
        if (sampling, load) not in self.settings:
            self.settings[sampling, load] = check_options(self.plans.options(sampling, in_flight=load))
            for note in self.plans.notes(sampling) if load == 1 else []:
                log.info(note)
        return self.settings[sampling, load]

    def decoder_for(self, sampling: Sampling, in_flight: int = 1) -> "Decoder":
        """The decoder for this sampling setting (and load: options_for), built on first use."""
        options = self.options_for(sampling, in_flight)
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

    def prompt(self, prompt: str | list[int], max_new_tokens: int, lookahead: int | None = None,
               name: str = "the prompt") -> Prompt:
        """The prompt as the models will see it (healed), checked against the context (`room`); `name` says which in
        an error."""
        if isinstance(prompt, str):
            ids = self.token_ids(prompt, name)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            if any(not 0 <= t < self.decoder.oracle.vocab_size for t in ids):
                raise InputError(f"{name}'s token ids must lie in 0..{self.decoder.oracle.vocab_size - 1}")
        else:
            raise InputError(f"a prompt is a string or a list of token ids (got {type(prompt).__name__})")
        return self.encode(ids, name, max_new_tokens, lookahead)

    def token_ids(self, text: str, name: str = "the prompt") -> list[int]:
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
            raise InputError(f"max_new_tokens must be at least 1 (got {max_new_tokens})", "max_new_tokens")
        if not ids:
            raise InputError(f"{name} is empty; give some text to continue")
        context, room = self.decoder.context(), self.room(len(ids), lookahead)
        if room < 1:
            raise InputError(f"{name} has {len(ids)} tokens; the models' context of {context} leaves no room to generate")
        if max_new_tokens > room:
            raise InputError(f"max_new_tokens {max_new_tokens} does not fit the context of {context} after "
                             f"{name} ({len(ids)} tokens); use at most {room}")
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

    def generate_batch(self, prompts: list, generation_config=None, **settings) -> list[Result]:
        """Decode several prompts (each text or token ids) together: each step scores every prompt's drafted tree in
        one oracle forward (decode.batch), which on a CPU costs little more than one prompt's. Each Result is what
        `generate` gives that prompt, token for token; the settings are generate's, the same for every prompt (a seed
        seeds each prompt's draws as it seeds generate's)."""
        if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)) or not prompts:
            raise InputError("generate_batch takes a non-empty list of prompts (each text or token ids)", "prompt")
        request = generation.request_of(generation_config, settings, sampling_of)
        self.hold()
        decodings: list[Generator[str, None, Result]] = []
        try:
            for i, prompt in enumerate(prompts):  # each joins the batch as it is checked
                decodings.append(self.joined(self.batch, prompt, request, True, len(prompts), f"prompt {i}"))
            results: dict[int, Result] = {}
            while len(results) < len(decodings):  # a step for every prompt in turn, each read as the step ends
                for i, decoding in enumerate(decodings):
                    if i not in results and (result := drain_one(decoding)) is not None:
                        results[i] = result
            return [results[i] for i in range(len(decodings))]
        finally:  # those joined before a prompt was refused, or left unread by a failure, leave the batch
            for decoding in decodings:
                decoding.close()
            self.busy.release()

    def stream_in(self, batch: Batch, prompt: str | list[int], generation_config=None, **settings) -> generation.Stream:
        """`stream`'s pieces for a prompt decoded as a sequence of `batch` (decode.batch), beside the others reading
        theirs in the same thread: a server's requests in flight. The prompt is checked and joins the batch at once:
        the batch's next step decodes it, whichever stream's reading runs that step."""
        request = generation.request_of(generation_config, settings, sampling_of)
        return generation.Stream(self.joined(batch, prompt, request, pieces=True))

    def joined(self, batch: Batch, prompt, request: generation.Request, pieces: bool,
               in_flight: int | None = None, name: str = "the prompt") -> Generator[str, None, Result]:
        """`decode` of the prompt, checked now, as a sequence of `batch`, on the decoder for `in_flight` requests
        decoding together (default: the batch's and this one) where its drafts fit the context after the prompt."""
        encoded = self.prompt(prompt, request.max_new_tokens, self.lookahead(request.sampling), name)
        decoder = self.decoder_for(request.sampling, len(batch) + 1 if in_flight is None else in_flight)
        if request.max_new_tokens > self.room(len(encoded.ids), decoder.lookahead()):  # the load's deeper tree
            decoder = self.decoder_for(request.sampling)
        steps = batch.join(decoder, encoded, request.max_new_tokens, request.seed, request.sampling)
        return self.decode(encoded, request, pieces, steps=steps)

    def hold(self) -> None:
        """Take the decoder for one decoding, or raise DecoderBusy."""
        if not self.busy.acquire(blocking=False):
            raise DecoderBusy("this decoder is already decoding another prompt (another thread's call, or a stream "
                              "not yet finished or closed); decode one prompt at a time on it, or use one decoder per thread")

    def decoding(self, prompt, request: generation.Request, pieces: bool, streamer=None) -> Generator[str, None, Result]:
        """`decode` with the prompt checked, holding the decoder from its first step to its last (or until the
        generator is closed): a second decoding meanwhile raises DecoderBusy."""
        self.hold()
        try:
            encoded = self.prompt(prompt, request.max_new_tokens, self.lookahead(request.sampling))
            return (yield from self.decode(encoded, request, pieces, streamer))
        finally:
            self.busy.release()

    def decode(self, prompt: Prompt, request: generation.Request, pieces: bool, streamer=None,
               steps: loop.Steps | None = None) -> Generator[str, None, Result]:
        """Decode an encoded prompt as the request says, reading its loop's `steps` (default: decoding it alone on
        the decoder for its sampling setting); with `pieces`, yield the new text
        after each oracle call. A piece holds only text that later tokens cannot change (CompletionText.settled): an
        incomplete UTF-8 sequence (decoded as U+FFFD) waits for its rest. The output ends at the request's stop
        conditions. Returns the Result."""
        if steps is None:
            steps = self.decoder_for(request.sampling).steps(prompt, request.max_new_tokens, request.seed,
                                                             request.sampling)
        text_of = CompletionText(prompt, self.tokenizer, self.decoder.stop_ids)
        start, sent, seen, stopped = time.perf_counter(), 0, 0, None
        checks = bool(request.eos_ids or request.stop_strings)
        if streamer is not None:
            streamer.put(prompt.ids.detach().cpu())
        try:
            for out in steps:
                stopped = request.stop_at(out.tokens, seen, text_of) if checks else None
                tokens = out.tokens if stopped is None else out.tokens[:stopped]  # the loop's own list, grown each step
                if streamer is not None and len(tokens) > seen:
                    streamer.put(torch.tensor(tokens[seen:]))
                seen = len(tokens)
                if pieces:
                    text, end = text_of(tokens), text_of.settled(tokens)
                    if end > sent:
                        yield text[sent:end]
                        sent = end
                if stopped is not None:
                    break
        finally:  # the loop ends here (a batch's sequence leaves its batch), whatever ended the reading
            steps.close()
        done = stopped is not None or (tokens and tokens[-1] in self.decoder.stop_ids)
        text = prompt.completion(self.tokenizer, tokens, self.decoder.stop_ids)  # whole, once: exactly the tokens' text
        result = Result(text, tokens, out.oracle_calls, out.draft_calls, time.perf_counter() - start, prompt.tail,
                        "stop" if done else "length")
        if pieces and len(result.text) > sent:  # the output ended inside a character, as generate's text does
            yield result.text[sent:]
        if streamer is not None:
            streamer.end()
        return result
