"""decode.report: a benchmark's JSON as a table again, and as the Markdown the docs generate from it."""
import json
from pathlib import Path

import pytest

from decode.cli import report

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
GREEDY, TOPK = RESULTS / "avx2-cpu-greedy.json", RESULTS / "avx2-cpu-topk.json"


def table_rows(printed: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in printed.splitlines() if line.startswith("|")]


def test_brief_markdown_keeps_the_chosen_rows_in_order_and_the_median_alone(capsys):
    report.main([str(GREEDY), str(TOPK), "--markdown", "--brief", "--methods", "staged,baseline,llamacpp-ngram"])
    printed = capsys.readouterr().out
    header, _, *rows = table_rows(printed)
    assert header == ["method", "greedy: tok/s", "speedup", "least repetitive half", "same output", "drafts",
                      "sampled: tok/s", "speedup", "least repetitive half", "drafts"]
    assert [row[0] for row in rows] == ["staged", "baseline", "llamacpp-ngram"]
    result = report.load_result(GREEDY)
    staged = result["summary"]["staged"]
    assert rows[0][1:3] == [f"{staged['tokens_per_second']:.1f}", f"{staged['speedup']['median']:.2f}x"]
    planned = staged["predicted"]["policy"]  # a chain of the draft's alone: what the plan chose on this CPU
    assert planned["parents"] == list(range(-1, planned["depth"])) and not planned["widths"]
    assert rows[0][5] == f"chain of {planned['depth']}" and rows[1][5] == rows[2][5] == "-"
    flags = result["settings"]["llamacpp_flags"]["llamacpp-draft"]
    assert f"llamacpp-draft `{flags}`" in printed  # the setting llama.cpp's peer ran at, named above the table


def test_the_drafts_column_names_a_planned_tree_and_the_trigrams_widths_below_it():
    settings = {"tree_sizes": {"staged": {"nodes": 9}}}
    shape = lambda policy: report.shape_of("staged", {"predicted": {"policy": policy}}, settings)
    assert shape({"parents": [-1, 0, 0, 1], "nodes": 4, "depth": 2, "widths": [2, 1]}) == "tree of 3, trigram widths 2x1"
    assert shape({"budget": 16, "widths": [4, 2, 1]}) == "tree of 16, trigram widths 4x2x1"
    assert shape({"k": 5}) == "chain of 5" and shape({"tokens": 16}) == "lookup of 16"
    assert report.shape_of("staged", {}, settings) == "9 nodes"  # no plan: the size the bench recorded


def test_full_markdown_has_every_method_with_its_spread_and_tokens_per_call(capsys):
    report.main([str(GREEDY), "--markdown"])
    header, _, *rows = table_rows(capsys.readouterr().out)
    assert "tokens/call" in header and [row[0] for row in rows] == list(report.load_result(GREEDY)["summary"])
    assert all(" (" in row[2] for row in rows)  # median (mean, min-max)


def test_a_method_the_results_do_not_hold_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        report.main([str(GREEDY), "--markdown", "--methods", "staged,medusa"])
    errors = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(errors) == 1 and "medusa" in errors[0] and "llamacpp-draft" in errors[0]


def test_the_forecast_table_puts_each_planned_methods_forecast_beside_its_measurement(capsys):
    report.main([str(GREEDY), "--markdown", "--forecast"])
    _, _, *rows = table_rows(capsys.readouterr().out)
    summary = report.load_result(GREEDY)["summary"]
    planned = [name for name, s in summary.items() if "predicted" in s]
    assert [row[0] for row in rows] == planned and planned
    staged = dict(zip(planned, rows))["staged"]
    measured = summary["staged"]["tokens_per_second"] / summary["baseline"]["tokens_per_second"]
    predicted = summary["staged"]["predicted"]
    low, high = predicted["speedup_interval"]  # the plan's 90% interval, beside its point forecast
    assert staged[1:] == [f"{predicted['tokens_per_call']:.2f}", f"{summary['staged']['tokens_per_oracle_call']:.2f}",
                          f"{predicted['speedup']:.2f}x ({low:.2f}-{high:.2f}x)", f"{measured:.2f}x"]


def test_an_engine_result_is_its_cost_curves_against_the_roofline(capsys):
    engine = RESULTS / "avx2-bench-engine.json"
    report.main([str(engine), "--markdown"])
    printed = capsys.readouterr().out
    curves = report.load_result(engine)["roofline"]["curves"]
    assert printed.count("| q | 1 | 2 | 4 | 8 | 16 | 32 | 64 |") == len(curves)
    first = next(iter(curves.values()))
    engine_ms = next(row for row in table_rows(printed) if row[0] == "engine ms")
    assert engine_ms[1:] == [f"{ms:.2f}" for ms in first["ms"]["engine"].values()]
    with pytest.raises(SystemExit) as exit_:
        report.main([str(engine), str(GREEDY), "--markdown"])
    assert exit_.value.code == 2


def test_a_gpu_engine_result_is_its_forwards_with_and_without_cuda_graphs(capsys):
    engine = RESULTS / "h200-qwen2.5-0.5b-engine.json"
    result = report.load_result(engine)
    assert "roofline" not in result  # a GPU's: no roofline measured there
    report.main([str(engine), "--markdown"])
    printed = capsys.readouterr().out
    rows = {row[0]: row[1:] for row in table_rows(printed)}
    [(model, plain)] = result["forward_ms"].items()
    assert rows["ms"] == [f"{ms:.2f}" for ms in plain.values()]
    ways = {"cuda_graphs": "with CUDA graphs", "compiled_layers": "with CUDA graphs and compiled layers"}
    measured = [key for key in ways if f"forward_ms_with_{key}" in result]
    assert measured == list(ways) and "generation_with_cuda_graphs" in result
    for key in measured:
        captured, way = result[f"forward_ms_with_{key}"][model], ways[key]
        assert rows[f"{way} ms"] == [f"{ms:.2f}" for ms in captured.values()]
        assert rows[f"{way} / without"] == [f"{captured[q] / plain[q]:.2f}" for q in plain]
        if f"generation_with_{key}" in result:
            assert f"{way} {result[f'generation_with_{key}']['ours_ms_per_token']:.2f} ms" in printed


def test_a_runs_line_gives_the_peak_memory_of_the_bench_and_of_llama_cpps_server(capsys):
    path = RESULTS / "avx2-gpt2-large-plain-bf16.json"
    report.main([str(path), "--markdown", "--brief"])
    result = report.load_result(path)
    bench, server = result["settings"]["peak_rss_mb"], result["summary"]["llamacpp-server"]["peak_rss_mb"]
    assert (f"peak resident memory: the bench {bench:.0f} MiB, llamacpp-server's server {server:.0f} MiB"
            in capsys.readouterr().out)


def test_a_runs_line_names_the_block_format_of_a_quantized_oracle_and_draft(tmp_path, capsys):
    result = report.load_result(RESULTS / "avx512-gpt2-large-plain-q8_0.json")
    report.main([str(RESULTS / "avx512-gpt2-large-plain-q8_0.json"), "--markdown", "--brief"])
    assert "bfloat16, q8_0 oracle, no plan" in capsys.readouterr().out
    result["settings"]["weights"] = {"oracle": "q8_0", "draft": "q4_0"}
    (tmp_path / "mixed.json").write_text(json.dumps(result))
    report.main([str(tmp_path / "mixed.json"), "--markdown", "--brief"])
    assert "bfloat16, q8_0 oracle, q4_0 draft, no plan" in capsys.readouterr().out


def test_a_runs_line_says_what_code_and_libraries_measured_it(tmp_path, capsys):
    import re

    from decode.provenance import provenance

    written = provenance()  # what bench, bench_engine and plan write: this checkout's commit, torch's, transformers'
    assert re.fullmatch(r"[0-9a-f]{12}(-dirty)?", written["commit"]) and written["torch"] and written["transformers"]
    result = report.load_result(GREEDY)
    result["settings"] |= written | {"llama_server": "0.5.0-dev (build 1, commit 0c1e570)"}
    (tmp_path / "new.json").write_text(json.dumps(result))
    report.main([str(tmp_path / "new.json"), "--markdown", "--brief"])
    assert (f", code {written['commit']} (torch {written['torch']}, transformers {written['transformers']}, "
            f"llama-server 0.5.0-dev (build 1, commit 0c1e570))") in capsys.readouterr().out
    report.main([str(GREEDY), "--markdown", "--brief"])  # a result from before they were recorded says so
    assert ", code not recorded;" in capsys.readouterr().out


def test_a_copy_of_a_commits_files_is_measured_under_the_commit_it_is_given(tmp_path, monkeypatch):
    from decode import provenance

    monkeypatch.delenv(provenance.COMMIT, raising=False)
    checkout = provenance.code_commit.__wrapped__()
    monkeypatch.setattr(provenance, "ROOT", tmp_path)  # a copied tree: no .git here or above it
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert provenance.code_commit.__wrapped__() == "unknown"
    monkeypatch.setenv(provenance.COMMIT, "74bc468a1b2c")
    assert provenance.code_commit.__wrapped__() == "74bc468a1b2c"
    monkeypatch.setattr(provenance, "ROOT", provenance.Path(provenance.__file__).resolve().parent.parent)
    assert checkout != "unknown" and provenance.code_commit.__wrapped__() == "74bc468a1b2c"  # over a stale history


def test_a_plans_projection_says_what_it_measured_and_borrowed_with_a_row_per_method(capsys):
    path = RESULTS / "avx2-quick-projection.json"
    report.main([str(path), "--markdown"])
    printed = capsys.readouterr().out
    projection = report.load_result(path)["projection"]
    assert printed.startswith("- a projection, not a measurement: a gpt2-large-shaped oracle")
    assert "- borrowed from the trained pair: the acceptance (tokens per call)" in printed
    _, _, *rows = table_rows(printed)
    assert [row[0] for row in rows] == list(projection["predicted"])
    staged = next(row for row in rows if row[0] == "staged")
    assert staged[3].startswith(f"{projection['predicted']['staged']['speedup']:.2f}x (")
    report.main([str(path)])  # a plan has its Markdown table alone: --markdown or not
    assert capsys.readouterr().out == printed
    with pytest.raises(SystemExit) as exit_:
        report.main([str(path), str(path)])
    assert exit_.value.code == 2 and "is shown alone: pass one" in capsys.readouterr().err


def test_a_plan_with_nothing_to_show_is_a_one_line_error_that_says_how_to_make_one(tmp_path, capsys):
    plan = json.loads((RESULTS / "avx2-quick-projection.json").read_text())
    del plan["projection"]  # a plan of an earlier version: no table of the kinds of tree either
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    with pytest.raises(SystemExit) as exit_:
        report.main([str(path), "--markdown"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and "make it again" in err


def test_quantized_models_reports_are_a_table_of_their_perplexities_beside_their_sources(capsys):
    paths = [RESULTS / f"cpu-{model}-q8_0-quantization.json" for model in ("oracle", "draft")]
    report.main([*map(str, paths), "--markdown"])
    rows = table_rows(capsys.readouterr().out)
    results = [json.loads(p.read_text()) for p in paths]
    assert [row[:2] for row in rows[2:]] == [[r["source"], "q8_0"] for r in results]
    assert rows[2][3] == f"{results[0]['perplexity']['source']:.2f}"
    with pytest.raises(SystemExit) as refused:
        report.main([str(paths[0]), str(GREEDY), "--markdown"])
    assert refused.value.code == 2


def test_which_method_to_use_is_our_fastest_by_median_speedup_per_run(tmp_path, capsys):
    report.main([str(GREEDY), str(TOPK), "--markdown", "--best"])
    rows = table_rows(capsys.readouterr().out)[2:]
    for row, path in zip(rows, (GREEDY, TOPK)):
        summary = report.load_result(path)["summary"]
        ours = {m: s["speedup"]["median"] for m, s in summary.items() if m != "baseline" and not m.startswith("llamacpp")}
        best = max(ours, key=ours.__getitem__)
        assert row[2:4] == [best, f"{ours[best]:.2f}x"] and row[4].startswith(("chain of", "tree of", "lookup of"))
    losing = report.load_result(TOPK)
    for method in losing["summary"].values():
        if "speedup" in method:
            method["speedup"]["median"] = min(method["speedup"]["median"], 0.9)
    (tmp_path / "losing.json").write_text(json.dumps(losing))
    report.main([str(tmp_path / "losing.json"), "--markdown", "--best"])
    assert table_rows(capsys.readouterr().out)[2][2:4] == ["baseline", "1.00x"]  # nothing beats plain decoding


def test_the_defaults_table_shows_what_each_device_and_setting_takes_without_a_plan(tmp_path, capsys):
    """A CPU's unplanned staged is the draft's chain, a GPU's the tree planned there, and a GPU's sampling plain
    decoding; each row's speedup is its run's row of that method, which must have decoded the same drafting."""
    runs = [RESULTS / f"{name}.json" for name in ("avx2-cpu-unplanned-greedy", "avx2-cpu-unplanned-topk",
                                                  "h200-greedy", "h200-unplanned-topk")]
    report.main([*map(str, runs), "--markdown", "--defaults"])
    rows = table_rows(capsys.readouterr().out)[2:]
    assert [row[2:4] for row in rows] == [["staged", "chain of 7"], ["staged", "chain of 4"],
                                          ["staged", "tree of 16, trigram widths 4x2x1"], ["baseline", "-"]]
    for row, path in zip(rows, runs):
        summary = report.load_result(path)["summary"]
        assert row[4] == f"{summary[row[2]]['speedup']['median']:.2f}x"
    other = report.load_result(runs[2])
    other["summary"]["staged"]["predicted"]["policy"]["widths"] = [2, 1]  # planned to another tree: not the default
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit) as exit_info:
        report.main([str(tmp_path / "other.json"), "--markdown", "--defaults"])
    assert exit_info.value.code == 2 and "holds no staged row decoded as it is without a plan" in capsys.readouterr().err
