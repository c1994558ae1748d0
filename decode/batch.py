"""Many sequences decoding at once. Each decodes on a decoder of its own over forks of the same loaded models
(`CachedLM.fork`: the weights shared, a cache each; `Decoder.over`), and every step runs each sequence's oracle
forward as one call (decode.models.together), which reads the weights once for all of them; the sequences whose
drafters draft a chain of the draft model's in one call (the plans' choice on a CPU) draft theirs together the same
way, a forward of every chain a draft step. Other drafters draft alone.

A sequence is its loop's coroutine (decode.loop) driven by the batch instead of by `loop.alone`: the same code,
the same random draws from its own generator, and logits bit for bit those it gets alone, so its output is what it
gets decoding alone, greedy or sampled. Sequences join and leave between steps; a joining one's long prompt is read a
C++ call's chunk a step (CachedLM.pieces), beside the others' trees.
"""
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar, cast

import torch

from decode import loop
from decode.drafting import Proposal
from decode.healing import Prompt
from decode.models.cached_lm import CachedLM, Call, ChainCall
from decode.models.together import chain_together, run_together
from decode.sampling import Sampling
from decode.tree import Tree

if TYPE_CHECKING:
    from decode.decoder import Decoder

T = TypeVar("T")


@dataclass
class Sequence:
    decoder: "Decoder"  # a fork of the decoder it joined with
    calls: loop.Calls
    proposal: Proposal | None = None  # the tree it waits for
    asked: deque[Call] = field(default_factory=deque)  # the oracle forward it waits for, as its pieces yet to run
    scored: list[torch.Tensor] = field(default_factory=list)  # the logits of its pieces run so far
    ready: deque[loop.Generation] = field(default_factory=deque)  # its Generations since its reader last read it
    done: bool = False
    failure: Exception | None = None


class Batch:
    """The sequences in flight, each read through the Generations `join` gives it; reading them runs `step`s of the
    whole batch as needed. A sequence decodes on forks of its decoder's models, kept for the next sequences once it
    ends: the caches a batch holds are its most sequences at once' (`reserve` makes them at once). Used from one
    thread."""

    def __init__(self) -> None:
        self.sequences: list[Sequence] = []
        self.spare: dict[int, list[CachedLM]] = {}  # id of a model -> its forks not in use

    def __len__(self) -> int:
        return len(self.sequences)

    def reserve(self, decoder: "Decoder", sequences: int) -> int:
        """Make the forks `sequences` sequences of this decoder need, now; the bytes of their caches."""
        needs = self.needs(decoder)
        for model, slots in needs:
            spare = self.spare.setdefault(id(model), [])
            spare.extend(model.fork(slots) for _ in range(sequences - len(spare)))
        return sum(fork.cache_bytes() for model, _ in needs for fork in self.spare[id(model)])

    @staticmethod
    def needs(decoder: "Decoder") -> list[tuple[CachedLM, int | None]]:
        """The decoder's models, the oracle first, each with the speculative slots a fork of it needs past the
        context: the oracle's, the most nodes a step scores (a fraction of the model's own room, which a draft's
        larger trees need); the draft's, its model's own."""
        needs: list[tuple[CachedLM, int | None]] = [(decoder.oracle, decoder.oracle_rows())]
        return needs + ([(decoder.draft, None)] if decoder.draft is not None else [])

    def fork(self, model: CachedLM, slots: int | None) -> CachedLM:
        """A spare fork of `model` with room for `slots` speculative nodes (None: the model's own room), else a new
        one."""
        spare, wanted = self.spare.setdefault(id(model), []), model.speculative_slots() if slots is None else slots
        for i, fork in enumerate(spare):
            room = fork.speculative_slots()
            if wanted is None or room is None or room >= wanted:
                return spare.pop(i)
        return model.fork(slots)

    def join(self, decoder: "Decoder", prompt: Prompt, max_new_tokens: int, seed: int, sampling: Sampling
             ) -> loop.Steps:
        """A sequence's Generations, as `decoder.steps` gives them alone: it joins the batch now, so that the next
        step, whoever's reading runs it, drafts and scores it too, and leaves it as they end or are closed (or, never
        read, as they are dropped)."""
        needs = self.needs(decoder)
        forks = [self.fork(model, slots) for model, slots in needs]
        lane = decoder.over(forks[0], forks[1] if len(forks) > 1 else None)
        sequence = Sequence(lane, lane.calls(prompt, max_new_tokens, seed, sampling))
        self.sequences.append(sequence)
        generations = self.generations(sequence, [(model, fork) for (model, _), fork in zip(needs, forks)])
        next(generations)  # into its try: from here on, closing it takes the sequence out of the batch
        return cast(loop.Steps, generations)

    def generations(self, sequence: Sequence, forks: list[tuple[CachedLM, CachedLM]]
                    ) -> Generator[loop.Generation | None, None, None]:
        """What `join` returns, once past its first yield (None); the sequence's forks (each with the model it forks)
        kept for the next sequences as it ends."""
        try:
            yield None
            while True:
                while not sequence.ready and not sequence.done:
                    self.step()
                if not sequence.ready:
                    if sequence.failure is not None:
                        raise sequence.failure
                    return
                yield sequence.ready.popleft()
        finally:  # ended, failed or closed: it leaves the batch between steps
            self.sequences.remove(sequence)
            for model, fork in forks:
                self.spare[id(model)].append(fork)

    def step(self) -> None:
        """Every sequence drafts (up to its next oracle call; their draft chains together), then one oracle forward
        scores all their calls: the next piece of each (a long prompt's chunks one a step, so that a request joining
        does not hold the others for the whole of its prompt)."""
        for sequence in self.sequences:
            if not sequence.asked and sequence.proposal is None and not sequence.done:
                advance(sequence, None)
        proposing = [(s, s.proposal) for s in self.sequences if s.proposal is not None]
        for (sequence, _), tree in zip(proposing, propose_together([proposal for _, proposal in proposing])):
            sequence.proposal = None
            if isinstance(tree, Exception):
                sequence.failure, sequence.done = tree, True
            else:
                advance(sequence, tree)
        waiting = [(s, s.asked[0]) for s in self.sequences if s.asked]
        if not waiting:
            return
        for (sequence, _), scored in zip(waiting, run_together([(s.decoder.oracle, piece) for s, piece in waiting])):
            sequence.asked.popleft()
            if isinstance(scored, Exception):  # its forward failed: it ends, failing, and the others go on
                sequence.failure, sequence.done = scored, True
                sequence.asked.clear()
                continue
            sequence.scored.append(scored)
            if not sequence.asked:
                logits = sequence.scored[0] if len(sequence.scored) == 1 else torch.cat(sequence.scored)
                sequence.scored = []
                advance(sequence, logits)


def advance(sequence: Sequence, answer) -> None:
    """Run a sequence's coroutine on to what it asks next: a tree (kept as `proposal`), a forward (kept as `asked`, in
    its pieces) or its end; a Generation on the way is ready for its reader."""
    try:
        asked = loop.resume(sequence.calls, answer)
    except Exception as failure:  # its own, kept for its reader
        sequence.failure, sequence.done = failure, True
        return
    if asked is None:
        sequence.done = True
    elif isinstance(asked, Proposal):
        sequence.proposal = asked
    elif isinstance(asked, Call):
        sequence.asked.extend(sequence.decoder.oracle.pieces(asked))
    else:
        sequence.ready.append(asked)


def propose_together(proposals: list[Proposal]) -> list[Tree | Exception]:
    """Each proposal's tree, as its `run` gives it, or the exception raised making it: the drafters that draft a chain
    of their draft model's in one call ask for it (Drafter.chain_call), and those chains run together
    (decode.models.together); the others propose alone."""
    calls = [attempt(p.drafter.chain_call, p.tokens, p.max_depth, p.sampling, p.generator) for p in proposals]
    chosen = iter(chain_together([call for call in calls if isinstance(call, ChainCall)]))
    trees: list[Tree | Exception] = []
    for proposal, call in zip(proposals, calls):
        if isinstance(call, Exception):
            trees.append(call)
        elif call is None:
            trees.append(attempt(proposal.run))
        elif isinstance(answer := next(chosen), Exception):
            trees.append(answer)
        else:
            trees.append(attempt(proposal.drafter.chained, call, answer))
    return trees


def attempt(make: Callable[..., T], *args) -> T | Exception:
    """What `make(*args)` returns, or the exception it raises."""
    try:
        return make(*args)
    except Exception as failure:
        return failure
