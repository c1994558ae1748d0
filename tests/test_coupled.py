"""Coupled exactness: same seed, same tokens as the baseline, for every method whose tree does not
depend on the oracle's randomness (tree and staged with top children, staged with the context
drafter, staged on a planned shape, ngram, lookup; not sampled children, which draw from the same generator).

Why this holds: such a tree is a function of the accepted tokens only, and sample-match walks it
by drawing, at each visited node, one token from the oracle's processed distribution p at that
prefix with the shared generator: one `sampling.sample` draw per emitted token, in output order,
from the same p the baseline draws its token from at the same prefix. So the generator's stream is
consumed identically and every draw lands on the same token (up to float rounding of p at a
category boundary, which these fixed seeds do not hit; a wrong rule shifts whole draws and fails at
once). The distribution tests (test_decode_tree, test_decode_engine) keep one case per rule."""
import pytest
import torch
from decode_models import PROMPTS

from decode import SpeculativeDecoder
from decode.tree import Shape

METHODS = {"tree": {"budget": 12, "tree_children": "top"}, "staged": {"budget": 16, "widths": [4, 2, 1], "tree_children": "top"},
           "staged-no-context": {"method": "staged", "budget": 16, "widths": [4, 2, 1], "context_drafter": False,
                                 "tree_children": "top"},
           "staged-shape": {"method": "staged", "tree_shape": Shape([-1, 0, 0, 1, 1, 2, 3, 6], [0, 0, 1, 0, 1, 0, 0, 0], 0.0),
                            "budget": 8, "depth": 4, "widths": [1], "tree_children": "top"},
           "ngram": {"budget": 16, "widths": [4, 2, 1]}, "lookup": {}}
SETTINGS = [{"temperature": 1.0}, {"temperature": 1.0, "top_k": 50}, {"temperature": 0.7, "top_p": 0.9},
            {"temperature": 1.3, "top_k": 20, "top_p": 0.8}]


@pytest.fixture(scope="module")
def decoders(bpe_run):
    build = lambda name, extra: SpeculativeDecoder.from_run(bpe_run["run"], **{"method": name, **extra})
    return {"baseline": build("baseline", {}), **{name: build(name, extra) for name, extra in METHODS.items()}}


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("sampling", SETTINGS)
def test_same_seed_same_tokens_as_the_baseline(decoders, name, sampling):
    for prompt in PROMPTS:
        for seed in range(5):
            expected = decoders["baseline"].generate(prompt, max_new_tokens=24, seed=seed, **sampling).token_ids
            assert decoders[name].generate(prompt, max_new_tokens=24, seed=seed, **sampling).token_ids == expected, (prompt, seed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_sampling_is_reproducible_and_coupled(bpe_run):
    """On CUDA the generator lives on the model's device (torch refuses a CPU generator for CUDA tensors)."""
    build = lambda method, **extra: SpeculativeDecoder.from_run(bpe_run["run"], method=method, device="cuda", **extra)
    base, chain = build("baseline"), build("speculative")
    staged = build("staged", budget=16, widths=[4, 2, 1], tree_children="top", cuda_graphs=False)  # graphs: the default
    graphed = build("staged", budget=16, widths=[4, 2, 1], tree_children="top", cuda_graphs=True)
    shaped = build(**METHODS["staged-shape"], cuda_graphs=True)  # staged on a shape: many small draft calls
    assert graphed.decoder.oracle.graphs is not None and staged.decoder.oracle.graphs is None
    greedy = base.generate(PROMPTS[0], max_new_tokens=24).token_ids
    assert shaped.generate(PROMPTS[0], max_new_tokens=24).token_ids == greedy
    for seed in range(3):
        sampling = {"temperature": 1.0, "top_k": 50, "seed": seed}
        expected = base.generate(PROMPTS[0], max_new_tokens=24, **sampling).token_ids
        assert base.generate(PROMPTS[0], max_new_tokens=24, **sampling).token_ids == expected
        assert staged.generate(PROMPTS[0], max_new_tokens=24, **sampling).token_ids == expected
        assert graphed.generate(PROMPTS[0], max_new_tokens=24, **sampling).token_ids == expected
        assert shaped.generate(PROMPTS[0], max_new_tokens=24, **sampling).token_ids == expected
        twice = [chain.generate(PROMPTS[0], max_new_tokens=24, **sampling).token_ids for _ in range(2)]
        assert twice[0] == twice[1]
