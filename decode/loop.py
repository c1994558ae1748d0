"""The decoding loops: plain autoregressive decoding (the baseline) and speculative decoding over a tree of
drafted tokens (a chain is the one-branch tree of standard speculative decoding). Both keep the same invariant:
a model's cache holds every token of the sequence but the last, which it has not seen yet.

Each loop is written once, as a coroutine (`*_calls`) that yields each forward it needs of the oracle as a Call and
is sent its logits, yields each tree it needs of its drafter as a Proposal and is sent the tree, and yields its
Generation after every oracle call. `alone` runs one sequence's calls one by one (`*_steps`: a generator of
Generations, so a caller can stream the tokens as they are accepted); decode.batch runs several sequences' calls
together. `baseline`, `tree_speculative` and `speculative` run one to the end. The tools
that time a step's parts wrap what the loop is given (decode.timing.steps): the loop itself times nothing.
Both read their random draws from the `generator` they are given through one `Uniforms`, a block at a time.
"""
from collections.abc import Callable, Collection, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from decode.drafting import ChainDrafter, Drafter, Proposal
from decode.healing import constrain_first
from decode.models.cached_lm import CachedLM, Call
from decode.sampling import Sampling, Uniforms
from decode.tensors import long_tensor
from decode.tree import Tree
from decode.verify import Target


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)  # the new tokens (an end-of-text token included)
    oracle_calls: int = 0
    oracle_nodes: int = 0  # positions the oracle scored, the prompt's last one on: its batch sizes, summed
    draft_calls: int = 0

    def add(self, new: list[int], max_new_tokens: int, stop_ids: Collection[int]) -> bool:
        """Append new tokens up to the limit or a token that ends the text; True when generation is done."""
        for token in new:
            self.tokens.append(token)
            if len(self.tokens) >= max_new_tokens or token in stop_ids:
                return True
        return False


# A loop's coroutine: sent each Call's logits and each Proposal's tree, and resumed with next() after each Generation
Calls = Generator["Call | Proposal | Generation", Any, None]
Steps = Generator[Generation, None, None]  # a loop's Generations, one after each oracle call


def resume(calls: Calls, answer: "torch.Tensor | Tree | None") -> "Call | Proposal | Generation | None":
    """What a loop's coroutine asks or yields next, sent the answer to what it asked (a Call's logits, a Proposal's
    tree; None: after a Generation, or to start it); None once it has ended."""
    try:
        return next(calls) if answer is None else calls.send(answer)
    except StopIteration:
        return None


def alone(run: Callable[[Call], torch.Tensor], calls: Calls) -> Steps:
    """A loop's Generations, each of its oracle calls run as it asks (`run`: the oracle's `run`), each proposal
    proposed by its drafter."""
    answer: torch.Tensor | Tree | None = None
    while (asked := resume(calls, answer)) is not None:
        if isinstance(asked, Call):
            answer = run(asked)
        elif isinstance(asked, Proposal):
            answer = asked.run()
        else:
            answer = None
            yield asked


def run_to_end(steps: Iterator[Generation]) -> Generation:
    """A generation loop's last Generation."""
    *_, last = steps
    return last


def baseline_calls(oracle: CachedLM, prompt: torch.Tensor, max_new_tokens: int, sampling: Sampling,
                   stop_ids: Collection[int], *, generator: torch.Generator | None = None, allowed: torch.Tensor | None = None) -> Calls:
    """One oracle call per token. `allowed` (a healed prompt's): the tokens the first one may be."""
    uniforms, kernels = Uniforms(generator), oracle.runtime.kernels
    oracle.reset()
    logits = constrain_first((yield Call(prompt, last=1, extend=True)), allowed)[0]
    out = Generation(oracle_calls=1, oracle_nodes=1)
    while True:
        done = out.add([kernels.choose(logits, sampling, uniforms)], max_new_tokens, stop_ids)
        yield out
        if done:
            return
        logits = (yield Call(long_tensor(out.tokens[-1:], oracle.device), extend=True))[-1]
        out.oracle_calls += 1
        out.oracle_nodes += 1


def tree_speculative_calls(oracle: CachedLM, prompt: torch.Tensor, max_new_tokens: int, sampling: Sampling,
                           stop_ids: Collection[int], *, drafter: Drafter, generator: torch.Generator | None = None,
                           allowed: torch.Tensor | None = None, verify: Callable | None = None) -> Calls:
    """The drafter proposes a tree, the oracle scores every node in one call, and the verifier walks it:
    sample-match for trees of ranked tokens, multi-draft rejection for drawn children. `verify`: another rule
    with their signature (`verification`'s by default; decode.cli.agreement passes one that records what the oracle's
    forwards computed)."""
    verify = verify or verification(oracle, drafter, sampling)
    uniforms = Uniforms(generator)
    oracle.reset()
    drafter.reset()
    tokens = prompt.tolist()
    out = Generation()
    if len(tokens) > 1:
        yield Call(prompt[:-1], last=0, extend=True)
        out.oracle_calls += 1
    while True:
        tree = yield Proposal(drafter, tokens, max_new_tokens - len(out.tokens) - 1, sampling, uniforms)
        cached = oracle.length
        logits = yield Call(tree.tokens, tree.positions(cached), tree.mask(oracle.device))
        logits, allowed = constrain_first(logits, allowed), None  # the root's row of the first step only
        out.oracle_calls += 1
        out.oracle_nodes += len(tree)
        path, following = verify(tree, Target(logits, sampling), uniforms)
        oracle.commit(path)
        drafter.accept(path)
        new = [tree.tokens[n] for n in path[1:]] + [following]
        tokens += new
        done = out.add(new, max_new_tokens, stop_ids)
        out.draft_calls = drafter.calls
        yield out
        if done:
            return


def verification(oracle: CachedLM, drafter: Drafter, sampling: Sampling) -> Callable:
    """The rule that verifies the drafter's trees: multi-draft rejection where its children are draws from the draft,
    else sample-match; the loops over the oracle's logits are its runtime's kernels (decode.models.runtime)."""
    kernels = oracle.runtime.kernels
    return kernels.multi_draft_rejection if drafter.draws(sampling) else kernels.sample_match


def baseline_steps(oracle: CachedLM, *args, **kwargs) -> Steps:
    return alone(oracle.run, baseline_calls(oracle, *args, **kwargs))


def tree_speculative_steps(oracle: CachedLM, *args, **kwargs) -> Steps:
    return alone(oracle.run, tree_speculative_calls(oracle, *args, **kwargs))


def baseline(*args, **kwargs) -> Generation:
    return run_to_end(baseline_steps(*args, **kwargs))


def tree_speculative(*args, **kwargs) -> Generation:
    return run_to_end(tree_speculative_steps(*args, **kwargs))


def speculative(oracle: CachedLM, prompt: torch.Tensor, max_new_tokens: int, sampling: Sampling,
                stop_ids: Collection[int], *, draft: CachedLM, k: int = 4, **options) -> Generation:
    """Standard (chain) speculative decoding: the draft samples k tokens, the oracle scores k + 1 positions in one
    call, Chen et al.'s rejection sampling (multi-draft rejection on a chain) verifies."""
    return tree_speculative(oracle, prompt, max_new_tokens, sampling, stop_ids, drafter=ChainDrafter(draft, k), **options)
