"""The lean engine's bucketed forwards (decode.models.cuda_graphs): padded to fixed shapes, the same logits and cache as
the engine's own forward, for GPT-2 and for the Llama family (Qwen2's q/k/v biases included). On a CPU they run
without graphs (the padding, the masks and the slots are what is tested); with CUDA they are also captured and
replayed."""
import pytest
import torch
from decode_models import oracle_and_good_draft

from decode.drafting import TreeDrafter
from decode.loop import baseline, speculative, tree_speculative
from decode.models.cuda_graphs import NODE_BUCKETS, CUDAGraphs
from decode.models.lean_engine import LeanEngine
from decode.models.loading import lean_engine_of
from decode.sampling import Sampling

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.fixture(scope="module", params=["gpt2", "qwen2"])
def models(tmp_path_factory, request):
    oracle, draft = oracle_and_good_draft(tmp_path_factory.mktemp(request.param), request.param, positions=512)
    return {"oracle": oracle, "draft": draft}


def engines(directory, device: str) -> tuple[LeanEngine, LeanEngine]:
    """The engine without graphs, and one whose forwards go through buckets (captured on CUDA)."""
    engine = lean_engine_of(directory)
    plain = engine.load(directory, device=device)
    bucketed = engine.load(directory, device=device, cuda_graphs=True)
    if device == "cpu":
        bucketed.graphs = CUDAGraphs(bucketed, capture=False)
    return plain, bucketed


def tree_mask(parents: list[int], device: str, pending: int = 3) -> torch.Tensor:
    """Each node sees `pending` slots before the tree, its ancestors and itself."""
    mask = torch.eye(len(parents), dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] |= mask[parent]
    return torch.cat([torch.ones(len(parents), pending, dtype=torch.bool), mask], 1).to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_bucketed_forwards_give_the_engines_logits_and_cache(models, device):
    plain, bucketed = engines(models["oracle"], device)
    ids = torch.randint(1, 97, (40,), generator=torch.Generator().manual_seed(0)).to(device)
    parents = [-1, 0, 0, 1, 1, 2, 3]
    depths = torch.tensor([0, 1, 1, 2, 2, 2, 3], device=device)
    for engine in (plain, bucketed):
        engine.outputs = [
            engine.extend(ids[:10]),  # a prefill: 16 nodes padded
            engine.extend(ids[10:11]),  # one node, no mask
            engine.append(ids[11:14]),  # a chain left pending
            engine.forward(ids[14:21], 14 + depths, tree_mask(parents, device)),  # a tree after it
        ]
        engine.commit([0, 1, 2, 3, 5])
        # a tree that sees part of the pending slots (the draft's levels before a commit)
        engine.forward(ids[21:23], torch.tensor([16, 16], device=device), torch.ones(2, 2, dtype=torch.bool, device=device))
        level = torch.tensor([[True, False, True, False], [False, True, False, True]], device=device)
        engine.outputs.append(engine.forward(ids[23:25], torch.tensor([17, 17], device=device), level))
        engine.commit([1, 3])
        engine.outputs.append(engine.extend(ids[25:26]))
    assert bucketed.length == plain.length == 19
    for ours, reference in zip(bucketed.outputs, plain.outputs, strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())
    length = plain.length
    cache = plain.kv_cache[..., :length, :]
    torch.testing.assert_close(bucketed.kv_cache[..., :length, :], cache, rtol=1e-5, atol=1e-5 * cache.abs().max().item())
    assert sorted(bucketed.graphs.buckets) == [(1, 256), (2, 256), (4, 256), (8, 256), (16, 256)]
    if device == "cuda":
        assert all(bucket.recorded is not None for bucket in bucketed.graphs.buckets.values())


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_decoding_through_buckets_equals_the_engines_baseline(models, device):
    plain, oracle = engines(models["oracle"], device)
    _, draft = engines(models["draft"], device)
    rng = torch.Generator().manual_seed(3)
    for trial in range(4):
        prompt = torch.randint(1, 97, (int(torch.randint(2, 12, (), generator=rng)),), generator=rng).to(device)
        expected = baseline(plain, prompt, 40, Sampling(), stop_ids={0}).tokens
        assert baseline(oracle, prompt, 40, Sampling(), stop_ids={0}).tokens == expected, trial
        for k in (1, 4):
            assert speculative(oracle, prompt, 40, Sampling(), stop_ids={0}, draft=draft, k=k).tokens == expected, (trial, k)
        drafter = TreeDrafter(draft, budget=12, depth=4, branch=3)
        assert tree_speculative(oracle, prompt, 40, Sampling(), stop_ids={0}, drafter=drafter).tokens == expected, trial


def test_forwards_past_the_largest_bucket_or_the_cache_run_without_one(models):
    _, engine = engines(models["oracle"], "cpu")
    largest = NODE_BUCKETS[-1]
    assert engine.graphs.get(largest, 0, largest).slots.numel() == largest
    assert engine.graphs.get(largest + 1, 0, largest + 1) is None  # a long prompt's prefill
    end = engine.capacity - 1
    assert engine.graphs.get(1, end - 1, end) is not None
    assert engine.graphs.get(4, end - 1, end + 3) is None  # its padding would pass the cache's last slot
    assert type(engine).load(models["oracle"], cuda_graphs=True).graphs is None  # a CPU keeps its own forward
