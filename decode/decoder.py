"""A method's models and drafter, built from resolved options: what decodes one sequence (SpeculativeDecoder builds
one for each sampling setting, over the same loaded models; decode.batch runs several over forks of them)."""
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from decode import loop
from decode.drafting import Drafter
from decode.errors import InputError, check_path
from decode.healing import Prompt, TokenHealer
from decode.methods import METHODS, check_tree_shape
from decode.models.cached_lm import CachedLM
from decode.models.loading import check_same_vocabulary, load_draft, load_model, load_trigram
from decode.options import DecoderOptions
from decode.sampling import Sampling
from decode.timing.steps import UNTIMED, Hooks
from decode.tokenizer import load_tokenizer, stop_ids


@dataclass
class Decoder:
    """A method's models and drafter: everything it needs to decode one prompt."""

    options: DecoderOptions
    oracle: CachedLM
    draft: CachedLM | None
    drafter: Drafter | None
    table: object | None  # the trigram's successor table, where the method drafts with it
    eos_id: int  # the tokenizer's end-of-text, which separates the documents the trigram counted
    stop_ids: frozenset[int]  # the tokens that end an output: eos_id and the model's generation_config.json's

    def steps(self, prompt: Prompt, max_new_tokens: int, seed: int, sampling: Sampling, verify: Callable | None = None,
              hooks: Hooks = UNTIMED) -> loop.Steps:
        """The generation so far after each oracle call. `verify`: a speculative method's verification rule in
        place of its own (decode.cli.agreement passes one that records what the oracle's forwards computed);
        `hooks` hear the time each part of a step takes."""
        return loop.alone(hooks.run(self.oracle), self.calls(prompt, max_new_tokens, seed, sampling, verify, hooks))

    def calls(self, prompt: Prompt, max_new_tokens: int, seed: int, sampling: Sampling, verify: Callable | None = None,
              hooks: Hooks = UNTIMED) -> loop.Calls:
        """`steps`' loop as its coroutine, which asks for each oracle forward (decode.loop)."""
        generator = torch.Generator(self.oracle.device).manual_seed(seed)  # torch samples with a generator on the tensors' device
        args = (self.oracle, prompt.ids, max_new_tokens, sampling, self.stop_ids)
        if self.drafter is None:
            return loop.baseline_calls(*args, generator=generator, allowed=prompt.allowed)
        verify = hooks.verify(verify or loop.verification(self.oracle, self.drafter, sampling))
        return loop.tree_speculative_calls(*args, drafter=hooks.drafter(self.drafter), generator=generator,
                                           allowed=prompt.allowed, verify=verify)

    def over(self, oracle: CachedLM, draft: CachedLM | None) -> "Decoder":
        """This decoder over forks of its models (CachedLM.fork: the weights shared, caches of their own), with a
        drafter of its own: another sequence decodes on it while this one decodes its own (decode.batch)."""
        build = METHODS[self.options.method].drafter
        drafter = None if build is None else build(self.options, draft, self.table)
        return Decoder(self.options, oracle, draft, drafter, self.table, self.eos_id, self.stop_ids)

    def __call__(self, prompt: Prompt, max_new_tokens: int, seed: int, sampling: Sampling,
                 hooks: Hooks = UNTIMED) -> loop.Generation:
        return loop.run_to_end(self.steps(prompt, max_new_tokens, seed, sampling, hooks=hooks))

    def context(self) -> int:
        return min(m.max_length for m in (self.oracle, self.draft) if m is not None)

    def oracle_rows(self) -> int:
        """The most nodes a step asks the oracle to score: the speculative slots its cache needs past the context."""
        return METHODS[self.options.method].rows(self.options)

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
    how = (options.oracle, options.backend, options.dtype, options.device, options.cuda_graphs,
           options.compile_layers)  # load_model's arguments
    oracle = loaded(models, ("oracle", *how), lambda: load_model(*how))
    tokenizer = load_tokenizer(options.oracle)
    draft = table = drafter = None
    if method.draft:
        check_same_vocabulary(options.oracle, require_draft(options.draft, f"--method {options.method}"), "draft")
        draft = loaded(models, ("draft", options.draft, options.backend, options.draft_dtype or options.dtype, options.device,
                                options.cuda_graphs, options.compile_layers, options.draft_vocab), lambda: load_draft(options, oracle.vocab_size))
        if draft.vocab_size != oracle.vocab_size:
            raise InputError(f"the oracle has {oracle.vocab_size} output tokens and the draft {draft.vocab_size}; they must match")
    if method.trigram:
        table = loaded(models, ("ngram", options.ngram), lambda: load_trigram(options, len(tokenizer), tokenizer.eos_token_id))
    if method.tree:
        check_tree_shape(options, table)
    if method.drafter is not None:
        drafter = method.drafter(options, draft, table)
    decoder = Decoder(options, oracle, draft, drafter, table, tokenizer.eos_token_id, stop_ids(options.oracle, tokenizer))
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
