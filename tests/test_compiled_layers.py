"""The lean engine's layers through torch.compile (compile_layers): the logits and cache of the engine's own forward to
float32 rounding, for GPT-2 and for the Llama family (Qwen2's q/k/v biases included), and greedy decoding by every
method equal to the compiled baseline's. On a CPU torch's forward is compiled (the C++ forward of a few rows left out,
so that every forward goes through it); with CUDA, inside the CUDA graphs."""
import pytest
import torch
from decode_models import oracle_and_good_draft
from torch._dynamo.utils import counters

from decode.drafting import TreeDrafter
from decode.loop import baseline, speculative, tree_speculative
from decode.models import runtime
from decode.models.cuda_graphs import CUDAGraphs
from decode.models.engine import GPT2Engine, gpt2_block
from decode.models.llama import llama_block
from decode.models.loading import lean_engine_of
from decode.models.projection import onednn_packs
from decode.sampling import Sampling

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.fixture(scope="module", params=["gpt2", "qwen2"])
def models(tmp_path_factory, request):
    return oracle_and_good_draft(tmp_path_factory.mktemp(request.param), request.param)


def load(directory, device: str, compile_layers: bool):
    return lean_engine_of(directory).load(directory, device=device, cuda_graphs=True, compile_layers=compile_layers)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_layers_give_the_engines_logits_and_cache(models, device):
    plain, compiled = (load(models[0], device, compile_layers) for compile_layers in (False, True))
    block = gpt2_block if isinstance(plain, GPT2Engine) else llama_block
    assert plain.runtime.layer(block) is block and compiled.runtime.layer(block) is not block
    ids = torch.randint(1, 97, (30,), generator=torch.Generator().manual_seed(0)).to(device)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool, device=device)
    for engine in (plain, compiled):
        engine.outputs = [engine.extend(ids[:12]), engine.extend(ids[12:13]), engine.append(ids[13:16]),
                          engine.forward(ids[16:20], torch.tensor([16, 17, 17, 18], device=device),
                                         torch.cat([torch.ones(4, 3, dtype=torch.bool, device=device), tree], 1))]
        engine.commit([0, 1, 3, 6])
        engine.outputs.append(engine.extend(ids[20:21]))
    for ours, reference in zip(compiled.outputs, plain.outputs, strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())
    cache = plain.kv_cache[..., : plain.length, :]
    torch.testing.assert_close(compiled.kv_cache[..., : compiled.length, :], cache, rtol=1e-5,
                               atol=1e-5 * cache.abs().max().item())


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_decoding_with_compiled_layers_equals_its_baseline(models, device):
    oracle, draft = (load(directory, device, True) for directory in models)
    rng = torch.Generator().manual_seed(3)
    for trial in range(3):
        prompt = torch.randint(1, 97, (int(torch.randint(2, 12, (), generator=rng)),), generator=rng).to(device)
        expected = baseline(oracle, prompt, 30, Sampling(), stop_ids={0}).tokens
        assert speculative(oracle, prompt, 30, Sampling(), stop_ids={0}, draft=draft, k=4).tokens == expected, trial
        drafter = TreeDrafter(draft, budget=12, depth=4, branch=3)
        assert tree_speculative(oracle, prompt, 30, Sampling(), stop_ids={0}, drafter=drafter).tokens == expected, trial


def test_compiled_layers_trace_each_variant_once_whatever_the_lengths(models):
    oracle = load(models[0], "cpu", True)
    oracle.graphs = CUDAGraphs(oracle, capture=False)  # the buckets' padded shapes, as CUDA graphs replay them
    rng = torch.Generator().manual_seed(5)

    def decode(length: int) -> None:
        baseline(oracle, torch.randint(1, 97, (length,), generator=rng), 24, Sampling(), stop_ids=set())

    decode(2)  # a prompt of 2 rows, as many as the cache's planes (keys, values), and rows of one after it
    traced = counters["stats"]["unique_graphs"]
    for length in (3, 16, 64, 100, 2):
        decode(length)
    assert counters["stats"]["unique_graphs"] == traced


def test_compiled_layers_store_a_calibrated_prepacked_matrix_unpacked(models, monkeypatch):
    if not onednn_packs(torch.float32):
        pytest.skip("oneDNN cannot prepack here")
    monkeypatch.setattr(runtime, "layout_for", lambda *_: "packed")  # as calibration chose it for every matrix
    plain, compiled = (load(models[0], "cpu", compile_layers) for compile_layers in (False, True))
    assert set(plain.layouts.values()) == {"packed"} and "packed" not in compiled.layouts.values()
    ids = torch.randint(1, 97, (12,), generator=torch.Generator().manual_seed(1))
    reference = plain.extend(ids)
    torch.testing.assert_close(compiled.extend(ids), reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())


def test_compiling_layers_without_a_cpp_compiler_is_a_one_line_error(models, tmp_path, capsys):
    """On a CPU the layers compile C++ as they first run: without a compiler decode.run refuses --compile-layers in
    one line, before it loads a model."""
    from torch._inductor import config

    from decode.cli import run

    with config.patch({"cpp.cxx": (None, str(tmp_path / "no-such-g++"))}), pytest.raises(SystemExit) as exited:
        run.main(["--oracle", str(models[0]), "--method", "baseline", "--prompt", "x", "--compile-layers"])
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert exited.value.code == 2
    assert "--compile-layers needs a C++ compiler on a CPU" in message and "leave out --compile-layers" in message
    run.main(["--oracle", str(models[0]), "--method", "baseline", "--prompt", "x", "--max-new-tokens", "2"])  # without it
