"""Generation loops with one signature: plain autoregressive decoding (the baseline) and speculative
decoding over a tree of drafted tokens (a chain is the one-branch tree of standard speculative
decoding). Both keep the same invariant: a model's cache holds every token of the sequence but the
last, which it has not seen yet.

Each loop is a generator (`*_steps`) that yields its Generation after every oracle call, so a caller
can stream the tokens as they are accepted; `baseline`, `tree_speculative` and `speculative` run one
to the end."""
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from decode.cached_lm import CachedLM, long_tensor
from decode.drafters import ChainDrafter
from decode.healing import constrain_first
from decode.sampling import Sampling
from decode.verify import Target, multi_draft_rejection, sample_match


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)  # the new tokens (an end-of-text token included)
    oracle_calls: int = 0
    oracle_nodes: int = 0  # positions the oracle scored, the prompt's last one on: its batch sizes, summed
    draft_calls: int = 0

    def add(self, new: list[int], max_new_tokens: int, eos_id: int | None) -> bool:
        """Append new tokens up to the limit or the end-of-text token; True when generation is done."""
        for token in new:
            self.tokens.append(token)
            if len(self.tokens) >= max_new_tokens or token == eos_id:
                return True
        return False


def last(steps: Iterator[Generation]) -> Generation:
    """Run a generation loop to the end."""
    for out in steps:
        pass
    return out


def baseline_steps(oracle: CachedLM, prompt: torch.Tensor, max_new_tokens: int, sampling: Sampling,
                   eos_id: int | None, generator: torch.Generator | None = None, allowed: torch.Tensor | None = None,
                   **_) -> Iterator[Generation]:
    """One oracle call per token. `allowed` (a healed prompt's): the tokens the first one may be."""
    oracle.reset()
    logits = constrain_first(oracle.extend(prompt, last=1), allowed)[0]
    out = Generation(oracle_calls=1, oracle_nodes=1)
    while True:
        done = out.add([sampling.choose(logits, generator)], max_new_tokens, eos_id)
        yield out
        if done:
            return
        logits = oracle.extend(long_tensor(out.tokens[-1:], oracle.device))[-1]
        out.oracle_calls += 1
        out.oracle_nodes += 1


def baseline(*args, **kwargs) -> Generation:
    return last(baseline_steps(*args, **kwargs))


def tree_speculative_steps(oracle: CachedLM, prompt: torch.Tensor, max_new_tokens: int, sampling: Sampling,
                           eos_id: int | None, generator: torch.Generator | None = None,
                           allowed: torch.Tensor | None = None, *, drafter, verify: Callable | None = None,
                           **_) -> Iterator[Generation]:
    """The drafter proposes a tree, the oracle scores every node in one call, and the verifier walks it:
    sample-match for trees built deterministically, multi-draft rejection for sampled children."""
    verify = verify or (multi_draft_rejection if drafter.sampled_children else sample_match)
    oracle.reset()
    drafter.reset()
    tokens = prompt.tolist()
    out = Generation()
    if len(tokens) > 1:
        oracle.extend(prompt[:-1], last=0)
        out.oracle_calls += 1
    while True:
        tree = drafter.propose(tokens, max_new_tokens - len(out.tokens) - 1, generator)
        cached = oracle.length
        logits = oracle.forward(tree.token_ids(oracle.device), tree.position_ids(cached, oracle.device),
                                tree.mask(oracle.device))
        logits, allowed = constrain_first(logits, allowed), None  # the root's row of the first step only
        out.oracle_calls += 1
        out.oracle_nodes += len(tree)
        path, following = verify(tree, Target(logits, sampling), generator)
        oracle.commit(path)
        drafter.accept(path)
        new = [tree.tokens[n] for n in path[1:]] + [following]
        tokens += new
        done = out.add(new, max_new_tokens, eos_id)
        out.draft_calls = drafter.calls
        yield out
        if done:
            return


def tree_speculative(*args, **kwargs) -> Generation:
    return last(tree_speculative_steps(*args, **kwargs))


def speculative_steps(oracle: CachedLM, prompt: torch.Tensor, max_new_tokens: int, sampling: Sampling,
                      eos_id: int | None, generator: torch.Generator | None = None, allowed: torch.Tensor | None = None,
                      *, draft: CachedLM, k: int = 4, verify: Callable | None = None, **_) -> Iterator[Generation]:
    """Standard (chain) speculative decoding: the draft samples k tokens, the oracle scores k + 1
    positions in one call, Chen et al.'s rejection sampling (multi-draft rejection on a chain) verifies."""
    return tree_speculative_steps(oracle, prompt, max_new_tokens, sampling, eos_id, generator, allowed,
                                  drafter=ChainDrafter(draft, sampling, k), verify=verify)


def speculative(*args, **kwargs) -> Generation:
    return last(speculative_steps(*args, **kwargs))
