"""How many requests a server decodes at once: as many as one oracle forward scores while each of them keeps most of
its speed alone, read off the oracle's measured forward costs (decode.planning.costs)."""
from decode.planning.costs import cost_curve

KEPT_SPEED = 0.6  # the share of its speed alone each request keeps at the batch size chosen
MOST_SEQUENCES = 16


def fitting_batch(costs: dict[int, float], rows: int, kept: float = KEPT_SPEED, most: int = MOST_SEQUENCES) -> int:
    """The most sequences (up to `most`) of `rows` nodes a step each whose forward together, by the cost table
    `costs` (milliseconds by nodes), costs at most 1 / `kept` times one sequence's forward: each of them then keeps
    `kept` of its speed alone (the drafting aside), and together they make that many times more tokens."""
    curve = cost_curve(costs, rows * most)
    alone = float(curve[rows])
    return max(n for n in range(1, most + 1) if float(curve[n * rows]) <= alone / kept)
