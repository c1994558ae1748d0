"""The kinds of tree a plan weighs for the draft model's methods, and each kind's best candidate: the figures that say
why a plan drafts the kind it does. A chain pays where one more node costs the oracle little and the draft's next
guess is often right; a branching tree where a node's second guess is right often enough to pay for its row in the
oracle's forward; the trigram's stage where its guesses save the draft's forwards more than they cost.
"""
KINDS = ("chain", "branching tree", "trigram stage")


def kind_of(method: str, policy: dict) -> str | None:
    """The kind of tree `method` drafts under `policy`; None for a method without the draft model's trees (the
    trigram alone, prompt lookup)."""
    if method == "speculative":
        return "chain"
    if method not in ("tree", "staged"):
        return None
    if policy.get("widths"):  # the trigram's guesses below the draft's nodes, or its tree that the draft prunes
        return "trigram stage"
    parents = policy["parents"]
    return "chain" if all(parent == node - 1 for node, parent in enumerate(parents)) else "branching tree"


def best_of_each_kind(ranked: dict[str, list[dict]]) -> dict[str, tuple[str, dict]]:
    """kind -> (method, prediction) of the least predicted ms per token among `ranked` (per method, its
    policies' predictions, as planning.search.forecast gives them), for each kind any policy is of."""
    best: dict[str, tuple[str, dict]] = {}
    for method, predictions in ranked.items():
        for p in predictions:
            kind = kind_of(method, p.get("policy", {}))
            if kind and (kind not in best or p["ms_per_token"] < best[kind][1]["ms_per_token"]):
                best[kind] = method, p
    return {kind: best[kind] for kind in KINDS if kind in best}


def with_choices(ranked: dict[str, list[dict]], chosen: dict[str, dict]) -> dict[str, list[dict]]:
    """`ranked` with each method's policies of the kind of its chosen one (`chosen`: per method, the prediction of the
    policy the plan chose) replaced by that choice: the plan measured its choice in a decoding loop, the others only
    priced it with the same factors, so the choice stands for its kind."""
    out = {}
    for method, predictions in ranked.items():
        if method not in chosen:
            out[method] = predictions
            continue
        kind = kind_of(method, chosen[method].get("policy", {}))
        out[method] = [chosen[method]] + [p for p in predictions if kind_of(method, p.get("policy", {})) != kind]
    return out


def kinds_table(ranked: dict[str, list[dict]], one_row_ms: float) -> list[dict]:
    """Each kind's best, in KINDS' order: its method and policy, nodes a step (mean), tokens per oracle call, the
    oracle's cost a call in one-row forwards (`one_row_ms`), the drafting's ms a call, ms per token and speedup."""
    return [{"kind": kind, "method": method, "policy": p["policy"], "nodes": p["mean_nodes"],
             "tokens_per_call": p["tokens_per_call"], "oracle_forwards_per_call": p["oracle_ms_per_call"] / one_row_ms,
             "drafting_ms_per_call": p["drafting_ms_per_call"], "ms_per_token": p["ms_per_token"],
             "speedup": p["speedup"]}
            for kind, (method, p) in best_of_each_kind(ranked).items()]
