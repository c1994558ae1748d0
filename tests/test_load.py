"""decode.load: clients at once against ours and llama-server's slots, as a user runs it; its figures from each
request's record."""
import json

import pytest
from test_decode_bench import bench_args

from decode.benchmarking import llama_server
from decode.benchmarking.load import Served, summary
from decode.cli import load
from decode.planning import costs


@pytest.fixture(autouse=True)
def cost_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(costs, "CACHE_DIR", tmp_path / "costs")


def test_load_measures_each_level_from_every_request(plan_run_models, tmp_path, capsys):
    out, plot = tmp_path / "load.json", tmp_path / "load.png"
    result = load.main(bench_args(plan_run_models, tmp_path, "--concurrency", "3,1", "--peers", "none", "--out", str(out),
                                 "--plot", str(plot)))
    rows = result["levels"]
    assert [(row["engine"], row["clients"]) for row in rows] == [("ours (staged)", 1), ("ours (staged)", 3)]
    for row in rows:
        assert row["requests"] == 3 and 0 < row["tokens"] <= 36
        assert 0 < row["first_token_p50_s"] <= row["first_token_p95_s"] <= row["seconds"]
        assert row["aggregate_tokens_per_s"] == pytest.approx(row["tokens"] / row["seconds"])
    assert json.loads(out.read_text())["levels"] == rows and {"commit", "torch", "machine"} <= result["settings"].keys()
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert "aggregate tok/s" in capsys.readouterr().out


def test_the_figures_are_each_requests_medians_and_percentiles():
    served = [Served(10, 1.0, 0.1), Served(20, 1.0, 0.2), Served(30, 2.0, 0.3), Served(40, 1.0, 1.3)]
    figures = summary(served, 4.0)
    assert figures["aggregate_tokens_per_s"] == 25.0 and figures["request_tokens_per_s"] == 17.5
    assert figures["first_token_p50_s"] == pytest.approx(0.25) and 1.0 < figures["first_token_p95_s"] < 1.3


@pytest.mark.parametrize("flags, message", [(["--concurrency", "0,2"], "use 1 to 64 clients"),
                                            (["--concurrency", "two"], "comma-separated numbers"),
                                            (["--peers", "vllm"], "unknown peers ['vllm']")])
def test_load_refuses_bad_flags_before_loading_anything(plan_run_models, tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        load.main(bench_args(plan_run_models, tmp_path, *flags))
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_llama_server_serves_each_level_with_a_slot_per_client(bpe_run, tmp_path):
    if llama_server.server_binary() is None:
        pytest.skip(llama_server.missing_reason())
    result = load.main(["--run", str(bpe_run["run"]), "--prompts", str(bpe_run["prompts"]), "--limit", "4",
                        "--max-new-tokens", "8", "--concurrency", "1,2", "--peers", "llamacpp-server,llamacpp-draft"])
    peers = [row for row in result["levels"] if row["engine"].startswith("llamacpp")]
    assert [(row["engine"], row["clients"]) for row in peers] == [("llamacpp-server", 1), ("llamacpp-server", 2),
                                                                 ("llamacpp-draft", 1), ("llamacpp-draft", 2)]
    assert all(row["requests"] == 4 and 0 < row["tokens"] <= 32 for row in peers)
    assert "llama_server" in result["settings"]
