"""The lossless property under sampling, tested with power.

Each case decodes the first three tokens of one prompt RUNS times on a 6-token vocabulary and
compares them with the oracle's exact distribution, enumerated (exactness.py): the joint of the
three tokens (216 cells) and the first token's marginal, each by a chi-square turned into a z-score.
A correct method exceeds Z_LIMIT with probability about 1e-4 per statistic and seed.

The mutants are plausible wrong rules; each must fail. Measured offline before choosing the run
counts (z of the worse statistic, seeds 0-3, one torch thread): residual never renormalised 8.9-10.4
(good draft) and 24-30 (bad draft) at 20,000; checked against a sharpened oracle (T 0.9) 11.4-11.9
at 20,000; acceptance scaled by 0.95, the subtlest, 3.8-4.8 at 20,000, 4.6-6.6 at 30,000 and 8.6-9.5
at 40,000 (seeds 1-2), so it runs 40,000 draws; correct rules 0.8-1.3. The gross mistakes (p
resampled after a rejection, the first token taken greedily) give z near 20 at a few thousand.
Power: at 20,000 draws the first-token test alone detects with 99% probability a bias that moves
2.2 points of probability onto the most likely first token (1.6 at 40,000); see the README.
"""
import functools

import pytest
import torch
from decode_models import tiny_gpt2, tiny_trigram
from exactness import Z_LIMIT, chi_square_z, exact_distribution

from decode.drafting import ChainDrafter, LookupDrafter, ShapedTreeDrafter, StagedDrafter, StagedShapeDrafter, TreeDrafter
from decode.loop import tree_speculative
from decode.models.engine import GPT2Engine
from decode.models.quantize_model import quantize_checkpoint
from decode.models.quantized import Q4_0, Q8_0
from decode.models.successors import SuccessorTable
from decode.sampling import Sampling, sample
from decode.shortlist import Shortlist
from decode.verify import Target, sample_match

pytestmark = pytest.mark.statistical

RUNS = 20_000  # correct methods, and the mutants that move probability by several points
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads cost more than they give
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("distribution")
    oracle = tiny_gpt2(root / "oracle", vocab_size=6, seed=10)
    bad = tiny_gpt2(root / "bad", vocab_size=6, seed=12)
    load = functools.partial(GPT2Engine.load, native_blocks=True)  # the C++ forward, as decoding runs it, where it builds
    return {"oracle": load(oracle), "bad": load(bad),
            "shortlisted": load(bad, shortlist=Shortlist([0, 2, 3, 5], 6)),  # q is 0 off the shortlist
            "good": load(tiny_gpt2(root / "good", vocab_size=6, seed=11, noise_from=oracle, noise=0.1)),
            "ngram": SuccessorTable.load(tiny_trigram(root / "ngram", oracle, documents=100, length=20) / "successors.npz")}


def z_scores(models, drafter, sampling: Sampling, runs: int, seed: int = 0, verify=None) -> tuple[float, float]:
    """(joint z, first-token z) of `runs` draws of three tokens."""
    oracle = models["oracle"]
    joint = exact_distribution(oracle, PROMPT, sampling, 3)
    first = {}
    for outcome, p in joint.items():
        first[outcome[:1]] = first.get(outcome[:1], 0.0) + p
    generator = torch.Generator().manual_seed(seed)
    draws = [tuple(tree_speculative(oracle, torch.tensor(PROMPT), 3, sampling, (), generator=generator, drafter=drafter,
                                    verify=verify).tokens) for _ in range(runs)]
    return chi_square_z(draws, joint), chi_square_z([d[:1] for d in draws], first)


def sampled_tree(models, sampling):
    return TreeDrafter(models["good"], budget=12, depth=3, branch=2, sampled=True)


CORRECT = {  # one case per verification rule, and the chain (Chen et al.'s rule)
    "chain, rejection sampling": (lambda m, s: ChainDrafter(m["bad"], k=2), Sampling(1.0)),
    "chain under top-k, rejection sampling over sparse distributions": (lambda m, s: ChainDrafter(m["bad"], k=2),
                                                                        Sampling(1.0, top_k=4)),
    "tree of sampled children under top-k and top-p, multi-draft rejection over sparse distributions": (
        lambda m, s: TreeDrafter(m["bad"], budget=12, depth=3, branch=2, sampled=True), Sampling(1.2, top_k=5, top_p=0.9)),
    "tree of sampled children, multi-draft rejection": (sampled_tree, Sampling(1.0)),
    "staged, sampled children and the context drafter, multi-draft rejection": (
        lambda m, s: StagedDrafter(m["bad"], m["ngram"], widths=[3, 2, 1], context=LookupDrafter(4, 2), depth=4,
                                   sampled=True), Sampling(0.9, top_k=4)),
    "a planned tree shape of sampled children, multi-draft rejection": (  # two, one and no draws below nodes
        lambda m, s: ShapedTreeDrafter(m["bad"], parents=[-1, 0, 0, 1, 1, 2, 3], ranks=[0, 0, 1, 0, 1, 0, 0],
                                       sampled=True), Sampling(1.0, top_k=5)),
    "staged on a planned shape of sampled children guessed ahead, multi-draft rejection": (
        lambda m, s: StagedShapeDrafter(m["bad"], m["ngram"], parents=[-1, 0, 0, 1, 1, 2, 3], ranks=[0, 0, 1, 0, 1, 0, 0],
                                        widths=[2, 1], context=LookupDrafter(3, 2), sampled=True), Sampling(1.0, top_k=5)),
    "staged on a planned shape of ranked children, sample-match": (
        lambda m, s: StagedShapeDrafter(m["good"], m["ngram"], parents=[-1, 0, 0, 1, 2, 3], ranks=[0, 0, 1, 0, 0, 0],
                                        widths=[1], context=LookupDrafter(3)), Sampling(0.9, top_k=4)),
    "chain from a draft with a shortlist, rejection sampling": (lambda m, s: ChainDrafter(m["shortlisted"], k=2),
                                                                Sampling(1.0)),
    "staged, sampled children from a draft with a shortlist, multi-draft rejection": (
        lambda m, s: StagedDrafter(m["shortlisted"], m["ngram"], widths=[3, 2, 1], depth=4, sampled=True), Sampling(1.0)),
    "staged, sampled children stopped by a budget of 5 nodes, multi-draft rejection": (  # draws below the first nodes only
        lambda m, s: StagedDrafter(m["bad"], m["ngram"], budget=5, widths=[3, 2, 1], context=LookupDrafter(4, 2),
                                   depth=4, sampled=True), Sampling(1.0)),
    "staged with the context drafter, sample-match": (
        lambda m, s: StagedDrafter(m["good"], m["ngram"], budget=12, widths=[3, 2, 1], draft_children=2,
                                   context=LookupDrafter(4, 2), depth=4), Sampling(0.9, top_k=4)),
    "staged carrying the draft's path down in more draft calls, sample-match": (
        lambda m, s: StagedDrafter(m["good"], m["ngram"], budget=12, widths=[2, 1], depth=5, draft_calls=3),
        Sampling(0.9, top_k=4)),
}


@pytest.mark.parametrize("case", CORRECT)
def test_correct_methods_sample_the_oracle_distribution(models, case):
    make, sampling = CORRECT[case]
    assert max(z_scores(models, make(models, sampling), sampling, RUNS)) < Z_LIMIT


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """A Q8_0 oracle, a Q4_0 draft of other weights, and the quantized oracle's trigram."""
    root = tmp_path_factory.mktemp("quantized")
    quantize_checkpoint(tiny_gpt2(root / "oracle16", vocab_size=6, seed=10), root / "oracle", Q8_0)
    quantize_checkpoint(tiny_gpt2(root / "bad16", vocab_size=6, seed=12), root / "bad", Q4_0)
    load = functools.partial(GPT2Engine.load, native_blocks=True)
    return {"oracle": load(root / "oracle"), "bad": load(root / "bad"),
            "ngram": SuccessorTable.load(tiny_trigram(root / "ngram", root / "oracle", documents=100, length=20) / "successors.npz")}


QUANTIZED = {  # a quantized oracle is a model of its own: decoding samples its distribution
    "chain, a Q4_0 draft for a Q8_0 oracle, rejection sampling": (lambda m: ChainDrafter(m["bad"], k=2), Sampling(1.0)),
    "staged, a Q4_0 draft for a Q8_0 oracle, multi-draft rejection": (
        lambda m: StagedDrafter(m["bad"], m["ngram"], widths=[3, 2, 1], context=LookupDrafter(4, 2), depth=4,
                                sampled=True), Sampling(0.9, top_k=4)),
}


@pytest.mark.parametrize("case", QUANTIZED)
def test_methods_sample_a_quantized_oracles_distribution(quantized, case):
    make, sampling = QUANTIZED[case]
    assert max(z_scores(quantized, make(quantized), sampling, RUNS)) < Z_LIMIT


def wrong_rejection(renormalise=True, scale=1.0, temperature=None, resample_from_p=False):
    """Multi-draft rejection with one mistake: the residual left unnormalised, the acceptance test
    scaled, the target sharpened to `temperature`, or p itself sampled after a rejection."""
    def verify(tree, target, generator):
        if temperature is not None:
            target = Target(target.logits, Sampling(temperature))
        path = [0]
        while True:
            node = path[-1]
            residual = target.probs(node)
            for child in tree.children[node]:
                q, x = tree.child_dists[node], tree.tokens[child]
                if generator.take(1)[0] * q[x] < scale * residual[x]:
                    path.append(child)
                    break
                left = (residual - q).clamp_min(0)
                residual = residual if resample_from_p else left / left.sum() if renormalise and left.sum() > 0 else left
            else:
                return path, sample(residual, generator)
    return verify


class GreedyRoot:
    """The paper code's habit: the first token taken greedily even when sampling."""

    def __init__(self, target):
        self.target, self.sampling = target, target.sampling

    def draw(self, node, generator):
        return int(self.target.probs(0).argmax()) if node == 0 else self.target.draw(node, generator)


MUTANTS = {  # name: (verification rule, runs)
    "residual never renormalised": (wrong_rejection(renormalise=False), RUNS),
    "acceptance scaled by 0.95": (wrong_rejection(scale=0.95), 40_000),  # the subtlest
    "checked against a sharpened oracle (T 0.9)": (wrong_rejection(temperature=0.9), RUNS),
    "p resampled after a rejection": (wrong_rejection(resample_from_p=True), 5_000),
    "first token taken greedily": (lambda tree, target, g: sample_match(tree, GreedyRoot(target), g), 5_000),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_each_wrong_rule_fails(models, mutant):
    verify, runs = MUTANTS[mutant]
    sampling = Sampling(1.0)
    assert max(z_scores(models, sampled_tree(models, sampling), sampling, runs, verify=verify)) > Z_LIMIT


def test_a_wrong_acceptance_in_the_cpp_walk_fails(models, tmp_path):
    """The C++ rejection walk (top-k sampling) with its acceptance test scaled by 0.95, the subtlest Python mutant's
    mistake, built from a copy of step.cpp: the same test catches it."""
    from decode import native
    from decode.kernels import NativeKernels

    if native.module() is None:
        pytest.skip("no C++ loops here: decoding runs the portable rule, which the mutants above test")
    source = tmp_path / "step.cpp"
    for original in (native.SOURCE, *native.SOURCE.parent.glob("*.h")):
        (tmp_path / original.name).write_text(original.read_text())
    right = "if (u * at(q, tokens[child]) < at(residual, tokens[child])) {"
    assert right in source.read_text()  # the acceptance test as the walk writes it
    source.write_text(source.read_text().replace(right, right.replace("< at(", "< 0.95 * at(")))
    wrong = NativeKernels(native.build(source))
    sampling = Sampling(1.0, top_k=5)
    assert max(z_scores(models, sampled_tree(models, sampling), sampling, 40_000, verify=wrong.multi_draft_rejection)) > Z_LIMIT


def test_the_correct_rule_written_like_the_mutants_passes(models):
    """The mutants' template with no mistake is decode.verify.multi_draft_rejection: what fails is the mistake."""
    sampling = Sampling(1.0)
    z = z_scores(models, sampled_tree(models, sampling), sampling, 5_000, verify=wrong_rejection())
    assert max(z) < Z_LIMIT
