"""How many requests a server decodes at once: as many as one oracle forward scores while each of them keeps most of
its speed alone, read off the oracle's measured forward costs (decode.planning.costs)."""
import torch

from decode.planning.costs import ContextCosts, cost_curve

KEPT_SPEED = 0.6  # the share of its speed alone each request keeps at the batch size chosen
MOST_SEQUENCES = 16


def fitting_batch(costs: dict[int, float], rows: int, kept: float = KEPT_SPEED, most: int = MOST_SEQUENCES) -> int:
    """The most sequences (up to `most`) of `rows` nodes a step each whose forward together, by the cost table
    `costs` (milliseconds by nodes), costs at most 1 / `kept` times one sequence's forward: each of them then keeps
    `kept` of its speed alone (the drafting aside), and together they make that many times more tokens."""
    curve = cost_curve(costs, rows * most)
    alone = float(curve[rows])
    return max(n for n in range(1, most + 1) if float(curve[n * rows]) <= alone / kept)


def shared_costs(tables: dict[int, dict[int, float]], largest: int, sequences: int) -> ContextCosts:
    """What a tree of q nodes costs one of `sequences` requests whose trees an oracle forward scores together: the
    forward of sequences x q nodes (after each cached length's table, as ContextCosts.of_tables), shared among them."""
    return ContextCosts({cached: cost_curve(table, sequences * largest)[::sequences] / sequences
                         for cached, table in tables.items()})


def shared_baseline(baseline: dict, one_row: torch.Tensor | float, shared_row: torch.Tensor | float) -> dict:
    """Plain decoding's costs for one of several requests decoded together: its one-token forward priced as its share
    of the forward of one row each (`shared_row`, against `one_row` alone); its prompt's forward and loop as alone."""
    return baseline | {"one_token": baseline["one_token"] * float(shared_row) / float(one_row)}

