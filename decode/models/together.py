"""Several sequences' forwards as one: each sequence decodes on its own fork of a model (CachedLM.fork), and the
calls whose forwards would each run as one C++ call run as a single C++ call over all their rows, which reads the
weights once for all of them (native.Blocks.batch). A row's logits do not depend on the other rows of its call, so
each call's logits are bit for bit those it gets run alone. The other calls (a long prompt, a model without a C++
forward, the calls of a group one of which is at fault) run alone, one after another."""
import torch

from decode.models.cached_lm import CachedLM, Call
from decode.models.lean_engine import LeanEngine


def run_together(calls: list[tuple[CachedLM, Call]]) -> list[torch.Tensor | Exception]:
    """Each (model, call)'s logits, as model.run(call) gives them, or the exception it raises there: a call that
    fails fails alone. The models are forks of one model, one per sequence."""
    together: dict[int, torch.Tensor] = {}  # a call's place -> its logits from a forward it shared
    groups: dict[int, list[tuple[int, LeanEngine, Call]]] = {}  # a C++ forward's address -> the calls it runs as one
    for i, (model, call) in enumerate(calls):
        if isinstance(model, LeanEngine) and model.batches(call):
            groups.setdefault(id(model.runtime.blocks), []).append((i, model, call))
    for group in (group for group in groups.values() if len(group) > 1):
        blocks = group[0][1].runtime.blocks
        assert blocks is not None  # `batches` says so only for a model with a C++ forward
        try:  # nothing is written before every part is checked: where one is at fault, each runs alone below
            logits = blocks.batch([engine.part(call) for _, engine, call in group])
        except Exception:
            continue
        for (i, engine, call), out in zip(group, logits):
            engine.settle(call)
            together[i] = out
    return [together[i] if i in together else alone(model, call) for i, (model, call) in enumerate(calls)]


def alone(model: CachedLM, call: Call) -> torch.Tensor | Exception:
    """The call's logits, run alone, or the exception it raises."""
    try:
        return model.run(call)
    except Exception as failure:
        return failure
