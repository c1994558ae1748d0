"""Several sequences' forwards as one: each sequence decodes on its own fork of a model (CachedLM.fork), and the
calls whose forwards would each run as one C++ call run as a single C++ call over all their rows, which reads the
weights once for all of them (native.Blocks.batch; a draft's chains, native.Blocks.chains, a step's forwards of every
chain at a time). A row's logits do not depend on the other rows of its call, so each call gets bit for bit what it
gets run alone. The other calls (a long prompt, a model without a C++ forward, the calls of a group one of which is
at fault) run alone, one after another."""
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

from decode.models.cached_lm import CachedLM, Call, ChainCall
from decode.models.lean_engine import LeanEngine

Asked = TypeVar("Asked")
Answer = TypeVar("Answer")


def run_together(calls: list[tuple[CachedLM, Call]]) -> list[torch.Tensor | Exception]:
    """Each (model, call)'s logits, as model.run(call) gives them, or the exception it raises there: a call that
    fails fails alone. The models are forks of one model, one per sequence."""

    def batch(group: list[tuple[LeanEngine, Call]]) -> list[torch.Tensor]:
        blocks = group[0][0].runtime.blocks
        assert blocks is not None  # `batches` says so only for a model with a C++ forward
        logits = blocks.batch([engine.part(call) for engine, call in group])
        for engine, call in group:
            engine.settle(call)
        return logits

    return together(calls, lambda engine, call: id(engine.runtime.blocks) if engine.batches(call) else None, batch,
                    lambda model, call: model.run(call))


def chain_together(calls: list[ChainCall]) -> list[tuple | Exception]:
    """Each draft chain's tokens and distributions, as call.run() gives them, or the exception it raises there. The
    calls' models are forks of one draft model, one per sequence."""

    def chains(group: list[tuple[LeanEngine, ChainCall]]) -> list[tuple]:
        engine = group[0][0]
        assert engine.runtime.blocks is not None  # a fork `chains` only with a C++ forward
        chosen = engine.runtime.blocks.chains([engine.chain_part(call) for engine, call in group], engine.shortlist)
        for engine, call in group:
            engine.chain_settle(call)
        return chosen

    return together([(call.model, call) for call in calls],
                    lambda engine, _: (id(engine.runtime.blocks), id(engine.shortlist)), chains,
                    lambda _, call: call.run())


def together(calls: list[tuple[CachedLM, Asked]], key: Callable[[LeanEngine, Asked], Hashable | None],
             run_group: Callable[[list[tuple[LeanEngine, Asked]]], list[Answer]],
             run_alone: Callable[[CachedLM, Asked], Answer]) -> list[Answer | Exception]:
    """Each call's answer: the calls of lean engines of the same `key` (None: a call that runs alone) as one
    `run_group`, the others by `run_alone`, each exception kept as the answer of the call that raised it. Nothing is
    written before every part of a group is checked: where one is at fault, each runs alone."""
    answers: dict[int, Answer] = {}  # a call's place -> its answer from a call it shared
    groups: dict[Hashable, list[tuple[int, LeanEngine, Asked]]] = {}
    for i, (model, call) in enumerate(calls):
        if isinstance(model, LeanEngine) and (shared := key(model, call)) is not None:
            groups.setdefault(shared, []).append((i, model, call))
    for group in (group for group in groups.values() if len(group) > 1):
        try:
            out = run_group([(engine, call) for _, engine, call in group])
        except Exception:
            continue
        answers.update((i, answer) for (i, _, _), answer in zip(group, out))
    return [answers[i] if i in answers else alone(run_alone, model, call) for i, (model, call) in enumerate(calls)]


def alone(run: Callable[[CachedLM, Asked], Answer], model: CachedLM, call: Asked) -> Answer | Exception:
    """The call's answer, run alone, or the exception it raises."""
    try:
        return run(model, call)
    except Exception as failure:
        return failure
