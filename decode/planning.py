"""Plan each method's tree from measurements on this device (Sequoia, Chen et al. 2024).

Greedy decoding makes planning exact: on a calibration prompt, the oracle's continuation after any
accepted prefix is the rest of its own greedy output, so a drafter can be replayed along it with no
oracle call, and the tokens it would have accepted are counted, step by step, as decoding would.

    acceptance   how often the oracle's token is the drafter's rank-k candidate at depth d (teacher forced)
    best_shapes  Sequoia's dynamic programme: the static tree of n nodes and depth D with the most
                 expected accepted tokens under those rates
    replay       a drafter with a given policy, along the oracle's greedy outputs: tokens per call,
                 drafting time per step (measured here) and the oracle's batch per step
    predict      tokens per call, ms per token and speedup, from a replay and the oracle's forward
                 costs (its own, or a larger shape's for a projection)

The plan (RUN/plan.json) records the policy with the best predicted ms per token for each method,
and what it was measured with: the models, the device, the dtype.
"""
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from data.atomic import write_json
from data.errors import InputError
from decode.cached_lm import CachedLM, long_tensor
from decode.costs import device_name, fingerprint

PLAN_VERSION = 1
PLANNED = ("speculative", "tree", "staged", "ngram", "lookup")
PAPER_WIDTHS, PAPER_BUDGET = (12, 7, 4, 1, 1, 1), 36  # the paper's staged tree, sized for a GPU
# Without a plan on a CPU: the trigram widths and budget that plans choose for the cpu preset there. The paper's tree
# has the draft score up to 1,441 nodes a step, which on a CPU is slower than plain decoding (docs/decoding.md).
CPU_WIDTHS, CPU_BUDGET = (3, 2, 1), 12


def default_tree(device: str) -> tuple[int, list[int]]:
    """The oracle's tree budget and the trigram's widths without a plan: sized for a CPU there, the paper's on a GPU."""
    if torch.device(device).type == "cpu":
        return CPU_BUDGET, list(CPU_WIDTHS)
    return PAPER_BUDGET, list(PAPER_WIDTHS)


def ranks(model: CachedLM, prompt: list[int], continuation: list[int]) -> list[int]:
    """The rank of each continuation token among the model's next-token logits (0: its argmax),
    the model reading the prompt and the continuation before it (teacher forcing)."""
    model.reset()
    logits = model.extend_whole(long_tensor(prompt + continuation[:-1], model.device))[len(prompt) - 1 :]
    target = logits.gather(1, long_tensor(continuation, model.device)[:, None])
    return (logits > target).sum(1).tolist()


def trigram_ranks(table, prompt: list[int], continuation: list[int]) -> list[int]:
    """The rank of each continuation token among the trigram's top successors (table.k: not among them)."""
    sequence = [table.bos] + prompt + continuation
    ends = np.arange(len(prompt) + 1, len(sequence))  # each continuation token's index in `sequence`
    u, v, token = np.array(sequence)[ends - 2], np.array(sequence)[ends - 1], np.array(sequence)[ends]
    successors, _ = table.lookup(u, v)
    hit = successors == token[:, None]
    return np.where(hit.any(1), hit.argmax(1), table.k).tolist()


def acceptance(rank_lists: list[list[int]], width: int, depth: int) -> list[list[float]]:
    """p[d][k]: how often the oracle's token at depth d + 1 of a tree is the drafter's rank-k
    candidate, among the places a tree of `width` children per node can reach (every token above
    it at a rank below `width`)."""
    hits = np.zeros((depth, width))
    reached = np.zeros(depth)
    for r in rank_lists:
        r = np.asarray(r)
        for start in range(len(r)):
            for d in range(min(depth, len(r) - start)):
                reached[d] += 1
                if r[start + d] >= width:
                    break
                hits[d, r[start + d]] += 1
    return (hits / np.maximum(reached, 1)[:, None]).tolist()


def overlaps(oracle: CachedLM, draft: CachedLM, sampling, prompt: list[int], continuation: list[int]) -> list[float]:
    """sum_x min(p(x), q(x)) of the processed distributions at each continuation position (teacher
    forced): the chance that the oracle accepts a token the draft samples there (Chen et al.)."""
    ids = long_tensor(prompt + continuation[:-1], oracle.device)
    dists = []
    for model in (oracle, draft):
        model.reset()
        dists.append(sampling.probs(model.extend_whole(ids)[len(prompt) - 1 :]))
    return torch.minimum(*dists).sum(-1).tolist()


def chain_acceptance(overlap_lists: list[list[float]], depth: int) -> list[float]:
    """For d = 1 .. depth, the chance that a sampled chain's first d tokens are all accepted: the mean
    over starting positions of the product of the next d overlaps."""
    totals, counts = np.zeros(depth), np.zeros(depth)
    for a in overlap_lists:
        for start in range(len(a)):
            prefix = np.cumprod(a[start : start + depth])
            totals[: len(prefix)] += prefix
            counts[: len(prefix)] += 1
    return (totals / np.maximum(counts, 1)).tolist()


@dataclass
class Shape:
    """A static tree of ranks: node i hangs below parents[i] as its rank-ranks[i] candidate."""

    parents: list[int]
    ranks: list[int]
    expected: float  # accepted nodes per step predicted by the rates it was built from

    @property
    def depth(self) -> int:
        depths = [0] * len(self.parents)
        for node, parent in enumerate(self.parents[1:], 1):
            depths[node] = depths[parent] + 1
        return max(depths)


def best_shapes(p: list[list[float]], max_nodes: int, depth: int) -> list[Shape | None]:
    """For n = 1 .. max_nodes (root included), the tree of at most `depth` levels with the most
    expected accepted nodes, when the oracle's token at depth d + 1 is the rank-k candidate with
    probability p[d][k], independently of the rest (Sequoia's positional acceptance). Entry n
    (None at 0, and where no such tree exists). The value of m nodes below an accepted node at depth d is a knapsack over its
    children's ranks: rank k, given s nodes, adds p[d][k] * (1 + value of s - 1 nodes below it)."""
    width, m_max = len(p[0]), max_nodes - 1
    below = [[0.0] + [-math.inf] * m_max for _ in range(depth + 1)]  # nothing fits below the deepest level
    split = {}  # (d, k) -> for m nodes among ranks k.., the nodes that rank k's subtree gets
    for d in reversed(range(depth)):
        rest = [0.0] + [-math.inf] * m_max  # ranks past the last: no nodes
        for k in reversed(range(width)):
            best, choice = rest[:], [0] * (m_max + 1)
            for m in range(1, m_max + 1):
                for s in range(1, m + 1):
                    sub, others = below[d + 1][s - 1], rest[m - s]
                    if sub > -math.inf and others > -math.inf:
                        value = p[d][k] * (1 + sub) + others
                        if value > best[m]:
                            best[m], choice[m] = value, s
            split[d, k], rest = choice, best
        below[d] = rest
    shapes = [None]
    for n in range(1, max_nodes + 1):
        if below[0][n - 1] == -math.inf:  # more nodes than `depth` levels of `width` children hold
            shapes.append(None)
            continue
        parents, node_ranks, depths, queue = [-1], [0], [0], [(0, n - 1)]
        for node, m in queue:  # level by level: the queue grows as children are placed
            for k in range(width):
                s = split[depths[node], k][m] if m and depths[node] < depth else 0
                if s:
                    parents.append(node)
                    node_ranks.append(k)
                    depths.append(depths[node] + 1)
                    queue.append((len(parents) - 1, s - 1))
                    m -= s
        shapes.append(Shape(parents, node_ranks, below[0][n - 1]))
    return shapes


@dataclass
class Replay:
    """What a drafter did along the oracle's greedy outputs."""

    prompts: int = 0
    steps: int = 0
    tokens: int = 0
    drafting_seconds: float = 0.0  # proposing and committing, measured
    nodes: list[int] = field(default_factory=list)  # the oracle's batch per step
    accepted: list[int] = field(default_factory=list)  # drafted tokens accepted per step

    def accepted_by_depth(self, depth: int) -> list[float]:
        """Share of steps that accept at least d drafted tokens, d = 1 .. depth."""
        a = np.array(self.accepted)
        return [float((a >= d).mean()) for d in range(1, depth + 1)]


def replay(drafter, sequences: list[tuple[list[int], list[int]]]) -> Replay:
    """Decode each (prompt, continuation) as greedy speculative decoding would, with the oracle's
    answer taken from the continuation: the accepted path is the longest branch that spells it. The
    drafter starts as a new decoder's does, with no trigram trees remembered."""
    forget(drafter)
    out = Replay()
    for prompt, continuation in sequences:
        drafter.reset()
        tokens, done = list(prompt), 0
        while done < len(continuation):
            start = time.perf_counter()
            tree = drafter.propose(tokens, len(continuation) - done - 1, None)
            path = [0]
            while done + len(path) < len(continuation):
                want = continuation[done + len(path) - 1]
                child = next((c for c in tree.children[path[-1]] if tree.tokens[c] == want), None)
                if child is None:
                    break
                path.append(child)
            drafter.accept(path)
            out.drafting_seconds += time.perf_counter() - start
            tokens += continuation[done : done + len(path)]  # the accepted nodes and the oracle's next token
            done += len(path)
            out.steps += 1
            out.nodes.append(len(tree))
            out.accepted.append(len(path) - 1)
        out.tokens += len(continuation)
        out.prompts += 1
    return out


def forget(drafter) -> None:
    """Drop the trigram trees a drafter remembers: its drafting time then starts where a new decoder's does."""
    if hasattr(drafter, "trigram"):
        drafter.trigram.forget()


def predict(replayed: Replay, oracle_ms: torch.Tensor, loop_ms: float, prefill_ms: float,
            drafting_factor: float = 1.0) -> dict:
    """Tokens per oracle call and ms per token: per prompt, the prefill (`prefill_ms`: one oracle call
    over the prompt, which yields no token when a tree follows); per step, the oracle's forward over
    the tree (`oracle_ms[q]`, measured for q nodes), the drafting measured in the replay (times
    `drafting_factor`: in a decoding loop the oracle's forwards evict the draft from the caches) and
    the rest of the loop (`loop_ms`, measured)."""
    oracle = float(oracle_ms[torch.tensor(replayed.nodes)].sum())
    drafting = 1e3 * replayed.drafting_seconds * drafting_factor
    total = prefill_ms * replayed.prompts + oracle + drafting + loop_ms * replayed.steps
    return {"tokens_per_call": replayed.tokens / (replayed.steps + replayed.prompts), "ms_per_token": total / replayed.tokens,
            "oracle_ms_per_call": oracle / replayed.steps,
            "drafting_ms_per_call": drafting / replayed.steps,
            "mean_nodes": float(np.mean(replayed.nodes))}


def ranked(candidates: list[dict], oracle_ms: torch.Tensor, loop_ms: float, prefill_ms: float, baseline_ms: float,
           drafting_factor: float = 1.0) -> list[dict]:
    """The candidate policies with their predictions, least predicted ms per token first."""
    out = []
    for c in candidates:
        p = predict(c["replay"], oracle_ms, loop_ms, prefill_ms, drafting_factor)
        out.append({"policy": c["policy"], **p, "speedup": baseline_ms / p["ms_per_token"],
                    "accepted_by_depth": c["replay"].accepted_by_depth(8)})
    return sorted(out, key=lambda c: c["ms_per_token"])


# A plan's identity besides the models, with the value a plan written before the setting existed was made with
SETTINGS = {"device": None, "dtype": None, "backend": None, "cuda_graphs": False}


def identity(options) -> dict:
    """What a plan's measurements depend on: the models, the device, the dtype, the backend and whether
    the forwards replay CUDA graphs (only on a GPU with the lean engine). The draft's shortlist and dtype are
    the plan's choice, in each policy."""
    graphs = options.cuda_graphs and torch.device(options.device).type == "cuda" and options.backend != "hf"
    return {"oracle": fingerprint(options.oracle), "draft": options.draft and fingerprint(options.draft),
            "ngram": options.ngram and fingerprint(options.ngram, "*.npz"),
            "device": device_name(torch.device(options.device)), "dtype": options.dtype, "backend": options.backend,
            "cuda_graphs": graphs}


def recorded(identity: dict, key: str):
    """A plan identity's `key`, or the default of a setting added after the plan was written."""
    return identity.get(key, SETTINGS.get(key))


def replan_command(run, options) -> str:
    return f"python -m decode.plan --run {run} --dtype {options.dtype}" + ("" if options.cuda_graphs else " --no-cuda-graphs")


def save_plan(plan: dict, path: Path, overwrite: bool) -> None:
    write_json(path, plan, overwrite, indent=1)


def run_plan(run: Path, options) -> Path | None:
    """RUN/plan.json when it exists and was measured on this device with this dtype and backend; when
    it was not, a one-line note says so and the flags' trees are used (a plan passed explicitly is
    refused instead, by load_plan)."""
    path = Path(run) / "plan.json"
    if not path.is_file():
        if options.method in ("tree", "staged", "ngram") and not {"widths", "budget"} & options.given:
            print(f"note: no plan in {run}, so {options.method} uses a tree sized for this device (--budget "
                  f"{options.budget}, --widths {','.join(map(str, options.widths))}); `python -m decode.plan --run {run}` "
                  f"plans each method's tree for these models", file=sys.stderr)
        return None
    try:
        measured = json.loads(path.read_text())["identity"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return path  # load_plan says what is wrong with it
    current = identity(options)
    other = [f"{k} {recorded(measured, k)!r}" for k in SETTINGS if recorded(measured, k) != current[k]]
    if other:
        print(f"note: {path} was planned for {', '.join(other)}; using the flags' trees (re-plan with "
              f"`{replan_command(run, options)}`)", file=sys.stderr)
        return None
    return path


# A planned tree (its shape) stands for the flags of a best-first tree all at once; every other key of a policy
# is the DecoderOptions field it fills ("tokens": lookup_tokens).
TREE_SHAPE, TREE_FLAGS = ("parents", "ranks", "expected", "nodes", "depth"), ("budget", "depth", "branch")


def option_of(key: str) -> str:
    """The DecoderOptions field a policy's `key` fills (a planned tree's shape aside)."""
    return "lookup_tokens" if key == "tokens" else key


def unless_given(policy: dict, method: str, given: frozenset[str]) -> dict:
    """The policy less what the caller set by hand (DecoderOptions.given): a flag they typed wins over the plan."""
    fills = lambda key: TREE_FLAGS if method == "tree" and key in TREE_SHAPE else (option_of(key),)
    return {key: value for key, value in policy.items() if given.isdisjoint(fills(key))}


def planned_options(policy: dict, method: str) -> dict:
    """The DecoderOptions values a policy gives, a planned tree's shape aside (`Shape`)."""
    return {option_of(key): value for key, value in policy.items() if not (method == "tree" and key in TREE_SHAPE)}


def describe(policy: dict) -> str:
    """A policy in words, its tree by its size (a planned tree's parents and ranks left out)."""
    return ", ".join(f"{k} {v}" for k, v in policy.items() if k not in ("parents", "ranks", "expected"))


def load_plan(path: Path, options) -> dict:
    """The plan's policies, checked to have been measured for these models on this device."""
    redo = f"re-plan with `{replan_command('RUN', options)}`, or pass --no-plan"
    if not Path(path).is_file():
        raise InputError(f"plan {path} does not exist; write one with `python -m decode.plan --run RUN`, or pass --no-plan")
    try:
        plan = json.loads(Path(path).read_text())
        policies, measured = plan["policies"], plan["identity"]
        if plan["version"] != PLAN_VERSION:
            raise ValueError
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise InputError(f"{path} is not a plan this version of decode.plan wrote; {redo}") from None
    current = identity(options)
    changed = [k for k in current if recorded(measured, k) != current[k]]
    if changed:
        what = ", ".join(f"{k} {recorded(measured, k)!r} (now {current[k]!r})" if k in SETTINGS else k
                         for k in changed)
        raise InputError(f"{path} was measured for another setting: {what} changed; {redo}")
    return policies
