"""Whether a greedy output that differs from the baseline's is a numerical near-tie or a bug, the check decode.agreement
and decode.bench share: the oracle's logit gap between the two tokens at the first differing step, scored in
forwards of several sizes, with its cache written in forwards of several sizes (a batched forward may round
differently than a single-token one). A near-tie's gap lies within how far rounding moves the logits there: the gap
itself, or the logit of any of the oracle's best tokens (`rounding_noise`). Where the replays do not settle it, the
method decodes the prompt again recording its own forwards: the row that chose the other token is a near-tie when
it holds every one of the oracle's best logits within that rounding of the baseline's (`own_moved`)."""
from collections.abc import Callable

import torch

from decode.healing import Prompt
from decode.loop import run_to_end
from decode.models.hf_backend import cache_keyword
from decode.models.runtime import TORCH
from decode.sampling import Sampling
from decode.verify import sample_match

# Forward sizes the diverging position is scored at: a matmul over another number of rows may round
# differently (in bfloat16 by up to a unit in the logits' last place: 0.03-0.06 at logits of 8-16); up to the
# largest tree a plan considers.
SHAPES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# The cache before it may have been written in such forwards too (a chain of k drafted tokens is scored
# in forwards of k + 1): on an H100 a gap of one bfloat16 unit, steady across SHAPES, still flipped.
CHUNKS = (2, 3, 4, 5, 6, 8)
TOP = 10  # the oracle's best tokens whose logits' spread across those forwards measures the rounding at a prefix


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def replayed_logits(oracle, context: list[int], prompt_length: int | None = None) -> torch.Tensor:
    """(replays, vocabulary) float32 logits after `context`: as the baseline computes it (the first
    `prompt_length` tokens in one forward, then token by token; first), then with the tokens after the prompt
    in forwards of 2, 3, ... tokens each (CHUNKS: the cache as a speculative method writes it), then its
    last position scored in one forward with the 1, 2, ... 63 tokens before it (SHAPES), and with the
    whole context. Where the oracle runs a forward of a few rows in C++ (whose rows do not depend on each other,
    so those replays agree) and a larger one in torch, the replays run again in torch's kernels: a method's tree
    past the C++ call's rows is computed there. A quantized oracle runs every forward in C++ (torch's forward of its
    dequantized weights computes another model's logits), so its replays are the C++ call's only."""
    rows = shaped_replays(oracle, context, prompt_length)
    if oracle.runtime.rows and not oracle.runtime.quantization:
        with oracle.runtime.forced(TORCH):
            rows = torch.cat([rows, shaped_replays(oracle, context, prompt_length)])
    return rows


def shaped_replays(oracle, context: list[int], prompt_length: int | None) -> torch.Tensor:
    """`replayed_logits`' replays in the kernels the oracle now runs (the baseline's first)."""
    rows, generated = [], context[prompt_length or len(context):]
    for chunk in (1, *CHUNKS) if generated else (1,):
        oracle.reset()
        logits = oracle.extend(torch.tensor(context[:prompt_length], device=oracle.device), last=1)[-1]
        for i in range(0, len(generated), chunk):
            logits = oracle.extend(torch.tensor(generated[i : i + chunk], device=oracle.device))[-1]
        rows.append(logits.float())
    for q in sorted({*(q for q in SHAPES if q <= len(context)), len(context)}):
        oracle.reset()
        if len(context) > q:
            oracle.extend(torch.tensor(context[:-q], device=oracle.device), last=0)
        rows.append(oracle.extend(torch.tensor(context[-q:], device=oracle.device))[-1].float())
    return torch.stack(rows).cpu()


def last_place(row: torch.Tensor) -> torch.Tensor:
    """The unit in the last place of each of a row of logits, in the precision they were computed in: bfloat16
    or float16 where every value of the row is exact in it (a model computing in it), else float32."""
    dtype = next(d for d in (torch.bfloat16, torch.float16, torch.float32) if torch.equal(row.to(d).float(), row))
    info = torch.finfo(dtype)
    return torch.exp2(torch.floor(torch.log2(row.abs().clamp_min(info.tiny)))) * info.eps


def best_moved(rows: torch.Tensor, a: int, b: int) -> float:
    """The largest spread across `rows` (computations of the same logits) of the oracle's TOP best logits in
    rows[0], a and b's among them, each counted in units of its own last place and applied at a and b's. Only
    logits of at least half the pair's magnitude count: nearer 0 a unit is finer than what rounds there."""
    units, first = last_place(rows[0]), rows[0]
    top = torch.cat([first.topk(min(TOP, rows.shape[1])).indices, torch.tensor([a, b])]).unique()
    pair, unit = first[[a, b]].abs().max(), float(units[[a, b]].max())
    moved = torch.where(first[top].abs() >= pair / 2, (rows[:, top].amax(0) - rows[:, top].amin(0)) / units[top], 0)
    return float(moved.max()) * unit


def rounding_noise(rows: torch.Tensor, gaps: list[float], a: int, b: int) -> float:
    """How far rounding moves the oracle's logits at a prefix, from its `replayed_logits`: the spread of tokens a
    and b's `gaps` across them, or the largest spread of the best tokens' logits (`best_moved`), and never less
    than one unit of a and b's last place, whichever is largest. A pair's gap can hold steady where its
    neighbours move (bfloat16 on a CPU with AMX: one unit, 0.0625, steady across every replay, while the methods'
    own forwards, with caches written in other shapes, saw 0; docs/exactness.md). The floor is the last
    rounding's own: two logits a hair apart before it can land a unit apart or together, so a one-unit gap is a
    tie under any other order of the same arithmetic, even where every replay rounds it alike (in float32 a unit
    at such logits is about 1e-6)."""
    unit = float(last_place(rows[0])[[a, b]].max())
    return max(max(gaps) - min(gaps), best_moved(rows, a, b), unit)


def own_rows(decoder, prompt: Prompt, max_new_tokens: int, seed: int) -> tuple[list[int], torch.Tensor]:
    """A greedy speculative method's output decoded again, with the oracle's logits row that chose each of its
    tokens as the method's own forwards computed it (a tree node's row, over a cache its earlier trees wrote):
    the tokens, and a (tokens, vocabulary) float32 row for each."""
    rows = []

    def recording(tree, target, generator):
        path, following = sample_match(tree, target, generator)
        rows.append(target.logits[path].float().cpu())  # the row of path[j] chose the j-th token this step emits
        return path, following

    tokens = run_to_end(decoder.steps(prompt, max_new_tokens, seed, Sampling(), verify=recording)).tokens
    return tokens, torch.cat(rows)[: len(tokens)]


@torch.inference_mode()
def peer_gaps(model, context: list[int], a: int, b: int, prompt_length: int) -> list[float]:
    """logit[a] - logit[b] after `context` as a transformers model computes it in `generate`: the prompt in one
    forward, then the tokens after it one at a time (plain generate; first), then a few at a time (CHUNKS:
    assisted generation and prompt lookup score their candidates in one forward on the cache)."""
    ids, cache, gaps = torch.tensor([context], device=model.device), cache_keyword(model), []
    for chunk in (1, *CHUNKS):
        out = model(ids[:, :prompt_length], use_cache=True)
        for i in range(prompt_length, len(context), chunk):
            out = model(ids[:, i : i + chunk], use_cache=True, **{cache: out[cache]})
        logits = out.logits[0, -1].float()
        gaps.append(float(logits[a] - logits[b]))
    return gaps


def divergence(oracle, prompt: Prompt, expected: list[int], got: list[int], peer=None,
               own: Callable[[], tuple[list[int], torch.Tensor]] | None = None) -> dict | None:
    """Where a greedy output first differs from the baseline's, and whether that is a numerical near-tie:
    the oracle's logit gap between the two tokens lies within how far rounding moves it, or the best tokens'
    logits, across forward sizes (`rounding_noise`: measured at that prefix, not assumed). `got` from a peer
    (`peer`, with its own kernels): its own gaps at the prefix (`peer.gaps`), token by token and in chunks, count
    among the forwards. `got` from one of our methods (`own`: its `own_rows`, decoded again only when the replays do not
    settle it): the method's own forward is a near-tie too when it computed every one of the best logits
    within that rounding of the baseline's, so that only the pair's order moved (`own_moved`): a tree forward
    over a cache that trees wrote can round a gap by a unit more than any replay (docs/exactness.md), while a
    wrong mask or position moves the whole row. An output that stops early or runs on is never a near-tie."""
    at = first_divergence(expected, got)
    if at is None:
        return None
    a, b = (seq[at] if at < len(seq) else None for seq in (expected, got))
    if a is None or b is None:
        return {"position": at, "expected": a, "got": b, "gap": None, "noise": None, "near_tie": False}
    context = prompt.ids.tolist() + expected[:at]
    rows = replayed_logits(oracle, context, len(prompt.ids))
    gaps = (rows[:, a] - rows[:, b]).tolist()
    if peer is not None:
        gaps += peer.gaps(context, a, b, len(prompt.ids))
    noise = rounding_noise(rows, gaps, a, b)
    diff = {"position": at, "expected": a, "got": b, "gap": gaps[0], "noise": noise, "near_tie": abs(gaps[0]) <= noise}
    if not diff["near_tie"] and own is not None:
        tokens, chosen = own()
        if tokens[: at + 1] == got[: at + 1]:  # the same output again: these are the forwards that chose b
            diff["own_moved"] = best_moved(torch.stack([rows[0], chosen[at].to(rows.dtype)]), a, b)
            diff["near_tie"] = diff["own_moved"] <= noise and abs(gaps[0]) <= 2 * noise
    return diff


def describe(diff: dict) -> str:
    """Why a divergence is not a near-tie, in words."""
    if diff["gap"] is None:
        return "one output ends where the other goes on"
    why = (f"logit gap {diff['gap']:.3g} outside the {diff['noise']:.3g} rounding moves logits there across forward sizes")
    if "own_moved" in diff:
        why += f", and the method's own forward moved the best logits by {diff['own_moved']:.3g}"
    return why + ": not a near-tie"
