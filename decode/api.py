"""Staged speculative decoding from Python: build a decoder once, generate or stream many times.

    from decode import SpeculativeDecoder
    dec = SpeculativeDecoder.from_run("runs/default", method="staged", dtype="bfloat16")
    result = dec.generate("def fib(n):", max_new_tokens=64)       # .text, .token_ids, .oracle_calls, .seconds
    for piece in dec.stream("def fib(n):", max_new_tokens=64):    # text as tokens are accepted
        print(piece, end="", flush=True)

Every command-line tool builds its decoders here (`DecoderOptions` mirrors decode.run's flags), and
bad settings raise the same one-line InputError the tools print.
"""
import json
import math
import numbers
import threading
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Callable, Generator, Iterator

import numpy as np
import torch

from data.errors import InputError, first_line
from data.shards import TOKEN_COUNTS
from data.tokenizer import load_tokenizer
from decode import generate, generation, native, planning
from decode.cached_lm import CachedLM, Shortlist
from decode.drafters import ChainDrafter, LookupDrafter, NgramDrafter, ShapedTreeDrafter, StagedDrafter, TreeDrafter
from decode.engine import SPECULATIVE_SLOTS, GPT2Engine, is_lean_compatible, read_config
from decode.healing import Prompt, TokenHealer
from decode.hf_backend import HFEngine
from decode.precision import auto_dtype
from decode.sampling import Sampling

METHODS = ("baseline", "speculative", "tree", "staged", "ngram", "lookup")
NEEDS_DRAFT = {"speculative", "tree", "staged"}
NEEDS_NGRAM = {"staged", "ngram"}
MAX_BUDGET, MAX_DEPTH = 512, 64
MIN_DRAFT_VOCAB = 64  # a shortlist holds every draft's top children and a sampled proposal's 64 tokens


@dataclass
class DecoderOptions:
    """What a decoder is built from: the models, the method and its tree. decode.run's flags of the same names."""

    oracle: Path
    draft: Path | None = None
    ngram: Path | None = None
    method: str = "staged"
    k: int = 4
    budget: int | None = None  # None: sized for the device (planning.default_tree)
    depth: int = 8
    widths: list[int] | None = None  # None: sized for the device
    branch: int | None = None  # None: 4 for tree; staged: 1 top child (the draft's argmax), or 2 draws when sampled
    tree_children: str | None = None  # None: sampled (top when greedy, either way)
    plan: Path | None = None  # a plan.json (decode.plan): its policy for the method fills in k, budget, widths, ...
    context_drafter: bool = True
    lookup_tokens: int = 10
    lookup_branches: int = 1
    lookup_ngram: int = 3
    dtype: str = "auto"  # auto: bfloat16 where the device multiplies in it natively (decode.precision)
    draft_dtype: str | None = None  # None: the oracle's dtype
    device: str = "cpu"
    backend: str = "auto"
    cuda_graphs: bool = True  # the lean engine on a GPU: replay each forward's kernels as one graph (a CPU ignores it)
    draft_vocab: int = 0  # the draft's logits over its N most frequent training tokens only (0: every token)
    token_healing: bool = True
    given: frozenset[str] = frozenset()  # the options the caller set by hand: a plan fills in only the others

    @classmethod
    def of(cls, settings) -> "DecoderOptions":
        """The options among `settings` (any object with these attributes, such as parsed flags)."""
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})

    def check(self) -> "DecoderOptions":
        """Settings that cannot work, as InputError; returns the options with `branch` (but staged's, which
        depends on the sampling settings of each call) and `tree_children` resolved."""
        if self.method not in METHODS:
            raise InputError(f"unknown method {self.method!r}; choose from {', '.join(METHODS)}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise InputError(f"dtype must be auto, float32 or bfloat16 (got {self.dtype!r})")
        if self.draft_dtype not in (None, "float32", "bfloat16"):
            raise InputError(f"draft_dtype must be float32 or bfloat16 (got {self.draft_dtype!r})")
        if self.backend not in ("auto", "lean", "hf"):
            raise InputError(f"backend must be auto, lean or hf (got {self.backend!r})")
        if self.tree_children not in (None, "top", "sampled"):
            raise InputError(f"tree_children must be top or sampled (got {self.tree_children!r})")
        if self.k < 0:
            raise InputError(f"--k must be at least 0 (got {self.k})")
        if min(self.lookup_tokens, self.lookup_branches, self.lookup_ngram) < 1 or self.lookup_tokens > MAX_DEPTH:
            raise InputError(f"--lookup-tokens (1 to {MAX_DEPTH}), --lookup-branches and --lookup-ngram must be at least 1")
        if self.draft_vocab != 0 and self.draft_vocab < MIN_DRAFT_VOCAB:
            raise InputError(f"--draft-vocab {self.draft_vocab}: use 0 (the whole vocabulary) or at least {MIN_DRAFT_VOCAB} tokens")
        check_device(self.device)
        branch = self.branch if self.branch is not None or self.method == "staged" else 4
        children = self.tree_children or "sampled"
        budget, widths = planning.default_tree(self.device)
        dtype = self.dtype if self.dtype != "auto" else auto_dtype(self.device, None, self.oracle)[0]
        return replace(self, budget=budget if self.budget is None else self.budget,
                       widths=list(widths if self.widths is None else self.widths), dtype=dtype, branch=branch,
                       tree_children=children, given=frozenset(self.given))


def check_number(name: str, value, integer: bool = False) -> None:
    """`value` is a number (an integer with `integer`), as InputError: a string or None would fail deep inside."""
    kind = numbers.Integral if integer else numbers.Real
    if not isinstance(value, kind) or isinstance(value, bool):
        raise InputError(f"{name} must be {'an integer' if integer else 'a number'} (got {value!r})")


def sampling_of(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> Sampling:
    """The processed distribution's settings, checked (temperature 0: greedy)."""
    check_number("temperature", temperature)
    check_number("top_k", top_k, integer=True)
    check_number("top_p", top_p)
    if not 0 <= temperature < math.inf or not 0 < top_p <= 1 or top_k < 0:
        raise InputError(f"need a finite temperature >= 0, 0 < top-p <= 1 and top-k >= 0 (got {temperature}, {top_p}, {top_k})")
    return Sampling(temperature, top_k, top_p)


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


class SpeculativeDecoder:
    """One method over one set of models; `generate` and `stream` decode a prompt (text or token ids).

    One sequence at a time: the models' caches hold the sequence being decoded. A generate or stream that starts
    while another is decoding (another thread's, or an unfinished stream in this one) raises DecoderBusy at once,
    and the decoding in progress goes on unharmed. Use one decoder per thread, or take turns."""

    def __init__(self, options: DecoderOptions):
        self.options = options.check()
        self.decoder, self.healer = build_decoder(self.options)
        self.tokenizer = self.healer.tokenizer
        self.busy = threading.Lock()
        self.materialized = []  # temporary directories from_pretrained saved loaded models into

    @classmethod
    def from_run(cls, run: str | Path | None = None, *, oracle=None, draft=None, ngram=None, **options) -> "SpeculativeDecoder":
        """Models from a run directory (RUN/oracle, RUN/draft, RUN/ngram, and RUN/plan.json when it
        exists: plan=None turns it off) or given one by one; any other DecoderOptions field (method,
        dtype, device, budget, widths, ...) as a keyword, which wins over the plan's value."""
        if run is not None:
            run = Path(run)
            oracle, draft, ngram = oracle or run / "oracle", draft or run / "draft", ngram or run / "ngram"
        if oracle is None:
            raise InputError("pass a run directory or oracle=DIR")
        names = {f.name for f in fields(DecoderOptions)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise InputError(f"unknown options {unknown}; choose from {', '.join(sorted(names - {'oracle', 'draft', 'ngram'}))}")
        plan = options.get("plan", run and run / "plan.json")
        if options.get("dtype", "auto") == "auto" and plan is not None:
            options["dtype"] = auto_dtype(options.get("device", "cpu"), plan, oracle)[0]  # the plan's, where it has one
        chosen = DecoderOptions(Path(oracle), draft and Path(draft), ngram and Path(ngram),
                                **{"given": frozenset(options), **options}).check()
        if run is not None and "plan" not in options:
            chosen = replace(chosen, plan=planning.run_plan(run, chosen))
        return cls(chosen)

    @classmethod
    def from_pretrained(cls, oracle, draft=None, ngram=None, *, tokenizer=None, method: str | None = None,
                        **options) -> "SpeculativeDecoder":
        """A decoder as transformers' from_pretrained makes a model: `oracle` and `draft` each a directory, a hub
        name, or a model already loaded (with its `tokenizer`, which both models share); `ngram` a trigram
        directory (python ngram/build_katz.py). The method defaults to staged with all three, speculative with a
        draft, else baseline; every other DecoderOptions field is a keyword (dtype="auto" by default)."""
        keep = []  # temporary directories of models handed over loaded, kept as long as the decoder
        oracle_dir = pretrained_dir(oracle, tokenizer, keep, "oracle")
        draft_dir = draft if draft is None else pretrained_dir(draft, tokenizer, keep, "draft")
        method = method or ("staged" if draft is not None and ngram is not None else
                            "speculative" if draft is not None else "baseline")
        decoder = cls.from_run(oracle=oracle_dir, draft=draft_dir, ngram=ngram, method=method, **options)
        decoder.materialized = keep
        return decoder

    def prompt(self, prompt: str | list[int], max_new_tokens: int) -> Prompt:
        """The prompt as the models will see it (healed), checked against the context."""
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt, add_special_tokens=False).input_ids
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            if any(not 0 <= t < self.decoder.oracle.vocab_size for t in ids):
                raise InputError(f"prompt token ids must lie in 0..{self.decoder.oracle.vocab_size - 1}")
        else:
            raise InputError(f"a prompt is a string or a list of token ids (got {type(prompt).__name__})")
        return self.encode(ids, "prompt", max_new_tokens)

    def room(self, prompt_tokens: int, lookahead: int | None = None) -> int:
        """How many tokens a prompt of `prompt_tokens` tokens leaves to generate in the models' context: the drafts'
        lookahead and the token healing's back-off take their share."""
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
        request = generation.resolve(generation_config, settings, sampling_of)
        return drain(self.decoding(prompt, request, pieces=False, streamer=streamer))

    def stream(self, prompt: str | list[int], generation_config=None, **settings) -> generation.Stream:
        """The completion's text in pieces, as the oracle accepts tokens; they join to `generate`'s text, and the
        stream's `result` is generate's Result once the last piece is out. The settings are generate's."""
        return generation.Stream(self.decoding(prompt, generation.resolve(generation_config, settings, sampling_of),
                                               pieces=True))

    def decoding(self, prompt, request: generation.Request, pieces: bool, streamer=None) -> Generator[str, None, Result]:
        """`decode` with the prompt checked, holding the decoder from its first step to its last (or until the
        generator is closed): a second decoding meanwhile raises DecoderBusy."""
        if not self.busy.acquire(blocking=False):
            raise DecoderBusy("this decoder is already decoding another prompt (another thread's call, or a stream "
                              "not yet finished or closed); decode one prompt at a time on it, or use one decoder per thread")
        try:
            check_number("seed", request.seed, integer=True)
            encoded = self.prompt(prompt, request.max_new_tokens)
            self.use(request.sampling)
            return (yield from self.decode(encoded, request, pieces, streamer))
        finally:
            self.busy.release()

    def use(self, sampling: Sampling) -> None:
        self.decoder.use(sampling)

    def decode(self, prompt: Prompt, request: generation.Request, pieces: bool, streamer=None
               ) -> Generator[str, None, Result]:
        """Decode an encoded prompt with the current sampling settings (`use`); with `pieces`, yield the new text
        after each oracle call. A piece never ends inside a character: an incomplete UTF-8 sequence (decoded as
        U+FFFD) waits for its rest. The output ends at the request's stop conditions. Returns the Result."""
        text_of = lambda tokens: prompt.completion(self.tokenizer, tokens, self.decoder.eos_id)
        start, sent, seen, stopped = time.perf_counter(), 0, 0, None
        checks = bool(request.eos_ids or request.stop_strings)
        if streamer is not None:
            streamer.put(prompt.ids.detach().cpu())
        for out in self.decoder.steps(prompt, request.max_new_tokens, request.seed):
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
        done = stopped is not None or (tokens and tokens[-1] == self.decoder.eos_id)
        result = Result(text_of(tokens), tokens, out.oracle_calls, out.draft_calls, time.perf_counter() - start,
                        prompt.tail, "stop" if done else "length")
        if pieces and len(result.text) > sent:  # the output ended inside a character, as generate's text does
            yield result.text[sent:]
        if streamer is not None:
            streamer.end()
        return result


def pretrained_dir(model, tokenizer, keep: list, name: str) -> Path:
    """A directory that holds `model`: a local directory as it is, a hub name downloaded (huggingface_hub's cache),
    or a loaded transformers model saved with `tokenizer` into a temporary directory added to `keep`."""
    import tempfile

    if hasattr(model, "save_pretrained"):
        if tokenizer is None:
            raise InputError(f"a loaded {name} model needs its tokenizer: pass tokenizer=...")
        directory = tempfile.TemporaryDirectory(prefix=f"staged-speculative-{name}-")
        keep.append(directory)
        model.save_pretrained(directory.name)
        tokenizer.save_pretrained(directory.name)
        return Path(directory.name)
    if not isinstance(model, (str, Path)):
        raise InputError(f"{name} must be a directory, a hub name or a loaded transformers model (got {type(model).__name__})")
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(model), allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
    except Exception as err:  # not found, offline, no access: many kinds
        raise InputError(f"{name} {model!r} is not a directory, and the hub did not give it ({first_line(err)}); "
                         f"pass a local directory, or a hub name when online") from None


def check_device(device: str) -> None:
    """cpu, or cuda[:N] on a machine that has it."""
    try:
        parsed = torch.device(device)
    except RuntimeError:
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise InputError(f"unknown --device {device!r}; use cpu or cuda (cuda:N for the N-th GPU)")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"--device {device}: this machine has no CUDA device (or torch was built without CUDA); use --device cpu")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise InputError(f"--device {device}: there are only {torch.cuda.device_count()} CUDA devices")


def check_tree_shape(options, table) -> None:
    """Budget, depth and widths must describe a tree the drafters can build."""
    if not 2 <= options.budget <= MAX_BUDGET:
        raise InputError(f"--budget {options.budget} is out of range: the oracle's tree needs 2 to {MAX_BUDGET} nodes")
    if not 1 <= options.depth <= MAX_DEPTH:
        raise InputError(f"--depth {options.depth} is out of range: use 1 to {MAX_DEPTH}")
    if options.branch is not None and options.branch < 1:
        raise InputError(f"--branch {options.branch} must be at least 1")
    if options.method in NEEDS_NGRAM:
        if any(w < 1 for w in options.widths) or len(options.widths) > options.depth:
            raise InputError(f"--widths {options.widths} need a positive width per level and at most --depth {options.depth} levels")
        if max(options.widths) > table.k:
            raise InputError(f"--widths {options.widths} ask for {max(options.widths)} trigram children but {options.ngram} keeps "
                             f"only the top {table.k}; rebuild it with --successors {max(options.widths)} or narrow the widths")
        if options.widths[0] + 1 > options.budget:
            raise InputError(f"--widths {options.widths} do not fit --budget {options.budget}: the first level alone has "
                             f"{options.widths[0]} nodes; raise the budget or narrow the first width")
    if options.method == "staged":  # the draft scores the trigram's whole tree, and the context's continuations, in one call
        levels = np.cumprod(options.widths[: options.depth])
        scored = 1 + int(levels.sum()) + (options.lookup_tokens * options.lookup_branches if options.context_drafter else 0)
        if scored > SPECULATIVE_SLOTS:
            raise InputError(f"--widths {','.join(map(str, options.widths))} make a trigram tree of {1 + int(levels.sum()):,} nodes, "
                             f"which the draft scores in one call (with the context's continuations, {scored:,}); it holds at "
                             f"most {SPECULATIVE_SLOTS:,}: narrow the widths")


def load_trigram(options, vocab_size: int, eos_id: int):
    from ngram.successors import SuccessorTable

    if options.ngram is None:
        raise InputError(f"--method {options.method} needs the Katz trigram; pass --ngram DIR (python ngram/build_katz.py)")
    meta_path = Path(options.ngram) / "meta.json"
    if not meta_path.is_file():  # written last: without it the directory is not a finished trigram
        raise InputError(f"{options.ngram} has no meta.json, so python ngram/build_katz.py did not finish writing it (or it "
                         f"is not a trigram directory); build one with `python ngram/build_katz.py --out NEW_DIR`")
    try:
        meta = json.loads(meta_path.read_text())
        built_for = (int(meta["vocab_size"]), int(meta["eos_id"]))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
        raise InputError(f"{meta_path} is damaged ({type(err).__name__}: {err}); rebuild the trigram with "
                         f"`python ngram/build_katz.py --out {options.ngram} --overwrite`") from None
    table = SuccessorTable.load(Path(options.ngram) / "successors.npz")
    if built_for != (table.vocab_size, table.eos_id):
        raise InputError(f"{meta_path} says a vocabulary of {built_for[0]} tokens (end-of-text {built_for[1]}) but its "
                         f"successors.npz holds {table.vocab_size} ({table.eos_id}); rebuild the trigram with "
                         f"`python ngram/build_katz.py --out {options.ngram} --overwrite`")
    if table.vocab_size != vocab_size or table.eos_id != eos_id:
        raise InputError(f"the trigram in {options.ngram} was built for a vocabulary of {table.vocab_size} tokens "
                         f"(end-of-text {table.eos_id}), the oracle has {vocab_size} (end-of-text {eos_id}); rebuild it from this run")
    return table


def load_model(directory: Path, backend: str, dtype: str, device: str, cuda_graphs: bool = False,
               shortlist: Shortlist | None = None, draft: bool = False) -> CachedLM:
    """A model for decoding; a `draft`'s blocks run in C++ where they can (GPT2Engine's native_blocks)."""
    config = read_config(directory)
    if backend == "lean" or (backend == "auto" and is_lean_compatible(config)):
        return GPT2Engine.load(directory, dtype, device, cuda_graphs=cuda_graphs, shortlist=shortlist,
                               native_blocks=draft)
    return HFEngine.load(directory, dtype, device, shortlist=shortlist)


def draft_shortlist(draft_dir: Path, size: int, vocab_size: int) -> Shortlist | None:
    """The draft's `size` most frequent training tokens (None: the whole vocabulary, for 0 or at least its size)."""
    if size == 0 or size >= vocab_size:
        return None
    path = Path(draft_dir) / TOKEN_COUNTS
    if not path.is_file():
        raise InputError(f"--draft-vocab needs {path}, the draft's training token counts (training writes them beside "
                         f"the model; older models lack them): re-train the draft, or numpy.save there "
                         f"data.shards.token_counts(RUN/data)")
    try:
        counts = np.load(path)
    except (OSError, ValueError) as err:
        raise InputError(f"{path} is not a numpy array of token counts ({err}); re-train the draft") from None
    if counts.shape != (vocab_size,):
        raise InputError(f"{path} counts {counts.size} tokens, the draft has {vocab_size}; re-train the draft")
    return Shortlist.most_frequent(counts, size)


def load_draft(options: "DecoderOptions", vocab_size: int) -> CachedLM:
    """The draft model as the options load it, its output layer over `options.draft_vocab` tokens when set."""
    return load_model(options.draft, options.backend, options.draft_dtype or options.dtype, options.device, options.cuda_graphs,
                      draft_shortlist(options.draft, options.draft_vocab, vocab_size), draft=True)


def check_same_vocabulary(oracle_dir: Path, other_dir: Path, other: str) -> None:
    a, b = load_tokenizer(oracle_dir), load_tokenizer(other_dir)
    if a.get_vocab() != b.get_vocab():
        raise InputError(f"the oracle ({oracle_dir}) and the {other} ({other_dir}) use different tokenizers; "
                         f"train the {other} with the oracle's tokenizer")


@dataclass
class Decoder:
    """Everything a method needs to decode one prompt."""

    method: str
    oracle: CachedLM
    draft: CachedLM | None
    drafter: object | None
    sampling: Sampling
    k: int
    depth: int
    eos_id: int
    policy: dict | None = None  # the plan's policy the method was built with (None: the flags')

    def steps(self, prompt: Prompt, max_new_tokens: int, seed: int, verify: Callable | None = None) -> Iterator[generate.Generation]:
        """The generation so far after each oracle call. `verify`: a speculative method's verification rule in
        place of its own (decode.agreement passes one that records what the oracle's forwards computed)."""
        generator = torch.Generator(self.oracle.device).manual_seed(seed)  # torch samples with a generator on the tensors' device
        args = (self.oracle, prompt.ids, max_new_tokens, self.sampling, self.eos_id, generator, prompt.allowed)
        if self.method == "baseline":
            return generate.baseline_steps(*args)
        return generate.tree_speculative_steps(*args, drafter=self.drafter, verify=verify)

    def __call__(self, prompt: Prompt, max_new_tokens: int, seed: int) -> generate.Generation:
        return generate.last(self.steps(prompt, max_new_tokens, seed))

    def use(self, sampling: Sampling) -> None:
        """Decode with these sampling settings from now on (the drafters rank by them too)."""
        self.sampling = sampling
        if hasattr(self.drafter, "sampling"):
            self.drafter.sampling = sampling

    def context(self) -> int:
        return min(m.max_length for m in (self.oracle, self.draft) if m is not None)

    def lookahead(self) -> int:
        """Positions past the output a step may score: the drafted depth."""
        if self.method == "lookup":
            return self.drafter.length
        return {"baseline": 0, "speculative": self.k}.get(self.method, self.depth)


def apply_plan(options: "DecoderOptions") -> tuple["DecoderOptions", planning.Shape | None, dict | None]:
    """The options with the plan's policy for the method (its tree, and the draft's shortlist) in place
    of the options the caller did not set (`given`), the tree method's planned shape (None: the flags'
    best-first tree), and the policy as applied (None: no plan, none for the method, or all of it set by hand)."""
    if options.plan is None or options.method not in planning.PLANNED:
        return options, None, None
    policy = planning.load_plan(options.plan, options).get(options.method)
    policy = policy and planning.unless_given(policy, options.method, options.given)
    if not policy:
        return options, None, None
    options = replace(options, **planning.planned_options(policy, options.method))
    if "parents" not in policy:
        return options, None, policy
    shape = planning.Shape(policy["parents"], policy["ranks"], policy["expected"])
    return replace(options, budget=max(2, len(shape.parents)), depth=max(1, shape.depth)), shape, policy


def build_decoder(options: "DecoderOptions") -> tuple[Decoder, TokenHealer]:
    """The method's decoder, and the healer that turns prompt token ids into its prompts (its tokenizer: .tokenizer)."""
    if not Path(options.oracle).is_dir():
        raise InputError(f"oracle directory {options.oracle} does not exist; train one with train/finetune_oracle.py")
    options, shape, policy = apply_plan(options)
    oracle = load_model(options.oracle, options.backend, options.dtype, options.device, options.cuda_graphs)
    tokenizer = load_tokenizer(options.oracle)
    draft = table = drafter = None
    if options.method in NEEDS_DRAFT:
        if options.draft is None or not Path(options.draft).is_dir():
            raise InputError(f"--method {options.method} needs a draft model; pass --draft DIR (got {options.draft})")
        check_same_vocabulary(options.oracle, options.draft, "draft")
        draft = load_draft(options, oracle.vocab_size)
        if draft.vocab_size != oracle.vocab_size:
            raise InputError(f"the oracle has {oracle.vocab_size} output tokens and the draft {draft.vocab_size}; they must match")
    if options.method in NEEDS_NGRAM:
        table = load_trigram(options, len(tokenizer), tokenizer.eos_token_id)
    sampling = Sampling()  # greedy until `Decoder.use` says otherwise
    if options.method != "baseline" and torch.device(options.device).type == "cpu":
        native.module()  # built (or found built) now, not inside the first decode's time
    if options.method in ("tree", "staged", "ngram"):
        check_tree_shape(options, table)
    if options.method == "speculative":
        drafter = ChainDrafter(draft, sampling, options.k)
    elif shape is not None:
        drafter = ShapedTreeDrafter(draft, sampling, shape.parents, shape.ranks, options.tree_children == "sampled")
    elif options.method == "tree":
        drafter = TreeDrafter(draft, sampling, options.budget, options.depth, options.branch, sampled=options.tree_children == "sampled")
    elif options.method == "staged":
        context = LookupDrafter(options.lookup_tokens, options.lookup_branches, options.lookup_ngram) if options.context_drafter else None
        drafter = StagedDrafter(draft, table, sampling, options.budget, options.widths, options.branch, context, options.depth,
                                sampled=options.tree_children == "sampled")
    elif options.method == "ngram":
        drafter = NgramDrafter(table, options.budget, options.widths)
    elif options.method == "lookup":
        drafter = LookupDrafter(options.lookup_tokens, options.lookup_branches, options.lookup_ngram)
    decoder = Decoder(options.method, oracle, draft, drafter, sampling, options.k, options.depth, tokenizer.eos_token_id, policy)
    return decoder, TokenHealer(tokenizer, oracle.vocab_size, options.token_healing)
