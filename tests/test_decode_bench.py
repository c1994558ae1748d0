import json
import logging
import os
import re
import shlex
import shutil
import types

import numpy as np
import pytest
import torch
from decode_models import run_models

import decode.batch as batch_module
from decode import native
from decode.api import SpeculativeDecoder
from decode.benchmarking import batch_steps, explain, llama_server, peers, tables
from decode.cli import agreement, bench, bench_engine, profile_start, profile_step, report, run
from decode.decoder import Decoder
from decode.healing import Prompt
from decode.models.cached_lm import CachedLM
from decode.models.engine import GPT2Engine
from decode.models.runtime import Runtime
from decode.planning import costs
from decode.sampling import Sampling
from decode.timing import forwards
from decode.timing.steps import Timer


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return run_models(tmp_path_factory.mktemp("run"))


@pytest.fixture(autouse=True)
def cost_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(costs, "CACHE_DIR", tmp_path / "costs")
    return tmp_path / "costs"


def bench_args(models, tmp_path, *extra) -> list[str]:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"task_id": f"t{i}", "prompt": f"t{i + 2} t{i + 7} t{i + 3}"}) + "\n" for i in range(3)))
    return ["--oracle", str(models["oracle"]), "--draft", str(models["draft"]), "--ngram", str(models["ngram"]),
            "--prompts", str(prompts), "--max-new-tokens", "12", "--budget", "12", "--widths", "3,2,1", *extra]


def test_bench_compares_every_method_and_peer_with_the_baseline(models, tmp_path, capsys):
    out, plot = tmp_path / "results.json", tmp_path / "speedup.png"
    result = bench.main(bench_args(models, tmp_path, "--out", str(out), "--plot", str(plot)))
    summary = result["summary"]
    assert list(summary) == [m for m in bench.DEFAULT_METHODS.split(",") if m not in peers.LLAMACPP_PEERS + llama_server.SERVER_PEERS]
    plain = explain.least_repetitive_half([r["tokens"] for r in result["records"]["baseline"]])
    for name, s in summary.items():
        assert s["same_output"]["identical"] == 3, name
        assert s["speedup"]["min"] <= s["speedup"]["median"] <= s["speedup"]["max"]
        assert s["speedup"]["least_repetitive_half"] == pytest.approx(
            float(np.median([s["speedup"]["per_prompt"][i] for i in plain])))
        assert s["tokens"] == 36 and s["oracle_calls_per_token"] == pytest.approx(1 / s["tokens_per_oracle_call"])
    assert summary["baseline"]["tokens_per_oracle_call"] == 1 and summary["hf-generate"]["tokens_per_oracle_call"] == 1
    assert summary["staged"]["tokens_per_oracle_call"] > 1.5  # the draft is the oracle plus a little noise
    assert set(summary["staged"]["median_speedup_over"]) == {"speculative", "hf-assisted", "hf-lookup"}
    assert json.loads(out.read_text())["summary"]["staged"]["tokens"] == 36
    assert plot.read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "refused" not in printed
    assert "skipping llamacpp" in printed  # not installed, or these models' word-level tokenizer has no GGUF form
    drafts = {name: {"dtype": "float32", "vocabulary": "every token"} for name in ("speculative", "tree", "staged", "staged-paper")}
    assert result["settings"]["drafts"] == drafts
    loops = "C++" if native.module() is not None else "Python"
    assert result["settings"]["step_loops"] == loops and f"step loops in {loops}" in printed
    assert {"commit", "torch", "transformers"} <= result["settings"].keys()  # what measured it
    assert "  the draft: speculative float32, every token; tree float32, every token; staged float32" in printed
    assert "a prompt and its staged completion" in printed and "t2 t7 t3" in printed  # the first prompt, shown
    assert "Same output: 6 of 6 speculative methods gave exactly the baseline's tokens on all 3 prompts." in printed
    staged = summary["staged"]["tokens_per_second"] / summary["baseline"]["tokens_per_second"]
    assert f"staged decoding ran at {summary['staged']['tokens_per_second']:.0f} tokens/s, {staged:.2f}x" in printed
    assert ("Why slower" in printed) == (staged < 1)


def test_the_explanation_says_why_staged_lost_and_labels_the_forecast():
    summary = {"baseline": {"tokens_per_second": 500.0, "tokens_per_oracle_call": 1.0},
               "staged": {"tokens_per_second": 250.0, "tokens_per_oracle_call": 3.0}}
    step = {"oracle_ms_per_call": 2.5, "drafting_ms_per_call": 1.5, "speedup": 0.5}
    plan = {"predicted": {"staged": step},
            "projection": {"oracle": "gpt2-large", "predicted": {"baseline": {"ms_per_token": 45.8, "speedup": 1.0},
                                                                 "staged": {**step, "speedup": 3.2},
                                                                 "lookup": {**step, "speedup": 2.8}}}}
    lines = explain.explain(summary, plan, greedy=False)
    assert "planned staged decoding ran at 250 tokens/s, 0.50x the baseline's 500 tokens/s." in lines[1]
    assert lines[2].startswith("Why slower: an oracle call costs only 2.00 ms here, and a staged step took 12.00 ms "
                               "for 3.00 tokens (planned: the oracle's forward over the tree 2.50 ms, the draft and "
                               "the trees 1.50 ms)")
    assert lines[3].startswith("Forecast, not a measurement: with a gpt2-large-sized oracle on this machine (46 ms per "
                               "token alone) and these drafters, the plan predicts staged 3.20x")
    assert lines[3].endswith("the plan predicts staged 3.20x (python -m decode.plan --project-oracle).")
    assert explain.explain({"baseline": summary["baseline"]}, plan, greedy=True)[-1].endswith("(python -m decode.plan --project-oracle).")
    assert not any("Why slower" in line for line in explain.explain({**summary, "staged": {
        "tokens_per_second": 900.0, "tokens_per_oracle_call": 3.0}}, None, greedy=False))


def test_looping_completions_are_called_out():
    loop, code = [7, 9] * 64, list(range(128))
    assert explain.looping([code, code]) is None
    assert explain.looping([loop] + [code] * 9) is None  # one prompt in ten: the table stands
    assert explain.looping([loop, loop] + [code] * 8).startswith("Note: 2 of 10")
    assert explain.looping([loop, code, [3] * 128]).startswith("Note: 2 of 3 of the oracle's completions end in a loop "
                                                              "of at most 32 tokens")


def test_a_loop_is_a_repeating_tail_of_half_the_completion_and_the_least_repetitive_half_leaves_loops_out():
    code = list(range(100, 228))
    line = list(range(20))  # a loop of a 20-token line after 60 tokens of code: 68 of 128 tokens repeat it
    assert explain.loop_period(code[:60] + (line * 4)[:68]) == 20
    assert explain.loop_period(code[:80] + line * 2 + [5] * 8) is None  # two lines, then something else
    assert explain.loop_period(code) is None and explain.loop_period([3] * 128) == 1
    assert explain.repetition(code) == 0 and explain.repetition([3] * 128) == pytest.approx(124 / 125)
    completions = [[3] * 128, code, [7, 9] * 64, code[:64] * 2]  # the last repeats a stretch too long for a loop
    assert explain.least_repetitive_half(completions) == [1, 3]
    summary = {"staged": {"speedup": {"median": 3.0, "least_repetitive_half": 2.0}}}
    assert explain.loops_line(completions, summary) == ("Loops: 2 of 4 of the baseline's completions end in a loop of at "
                                                       "most 32 tokens; staged's median speedup on the least repetitive "
                                                       "half of the prompts 2.00x (3.00x on all).")


def test_a_looping_completion_is_shown_abridged():
    loop = "    return x\n" + '    """\n' * 40
    assert explain.abridged(loop) == ("    return x" + '\n    """' * 3 +  # the repeating stretch starts at x's newline
                                     "\n... (297 more characters repeating the last 8: this oracle loops)")
    assert explain.abridged("x" + "ab\n" * 40).endswith("ab\nab\nab\n... (111 more characters repeating the last 3: this oracle loops)")
    code = "    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\n\n"
    assert explain.abridged(code) == code


class OffByOneAtToken5(Decoder):
    def __call__(self, prompt, max_new_tokens, seed, sampling, hooks=None):
        out = super().__call__(prompt, max_new_tokens, seed, sampling)
        out.tokens[5] = (out.tokens[5] + 1) % 97
        return out


def test_bench_refuses_a_speedup_when_greedy_output_differs(models, tmp_path, capsys, monkeypatch):
    build = bench.build_methods

    def with_a_broken_method(names, settings, chosen):
        decoders, ours = build(names, settings, chosen)
        decoders["speculative"] = OffByOneAtToken5(**vars(decoders["speculative"]))
        return decoders, ours

    monkeypatch.setattr(bench, "build_methods", with_a_broken_method)
    summary = bench.main(bench_args(models, tmp_path, "--methods", "baseline,speculative,ngram"))["summary"]
    assert "speedup" not in summary["speculative"] and "speedup" in summary["ngram"]
    assert [d["task_id"] for d in summary["speculative"]["same_output"]["differences"]] == ["t0", "t1", "t2"]
    printed = capsys.readouterr().out
    assert "refused: output differs" in printed and "speculative differs from baseline on t1 at token 5" in printed


def test_bench_sampling_reports_tokens_per_call_without_comparing_outputs(models, tmp_path):
    summary = bench.main(bench_args(models, tmp_path, "--methods", "speculative,staged,hf-assisted",
                                    "--temperature", "1", "--top-k", "20"))["summary"]
    assert "same_output" not in summary["staged"] and summary["staged"]["tokens_per_oracle_call"] > 1


def test_the_plans_forecast_is_printed_beside_the_measurement(capsys):
    row = {"tokens_per_second": 300.0, "tokens_per_oracle_call": 2.0, "oracle_calls_per_token": 0.5,
           "mean_oracle_batch": 6.0,
           "speedup": {"median": 1.2, "mean": 1.2, "min": 1.0, "max": 1.4, "least_repetitive_half": 1.1}}
    summary = {"baseline": {**row, "tokens_per_second": 250.0, "tokens_per_oracle_call": 1.0},
               "staged": {**row, "predicted": {"tokens_per_call": 4.9, "speedup": 2.6}}}
    tables.print_table(summary, greedy=False)
    sampled = capsys.readouterr().out
    assert "staged           4.90 vs  2.00      2.60x vs  1.20x" in sampled
    assert "1.20x (1.20, 1.00-1.40)           1.10x" in sampled  # beside the median, the least repetitive half's


def test_bench_rejects_unknown_methods(models, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(bench_args(models, tmp_path, "--methods", "baseline,medusa"))
    assert exit_.value.code == 2 and "unknown methods ['medusa']" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["bench", "agreement"])
def test_a_bad_decoding_flag_is_reported_by_the_command_that_was_run(models, tmp_path, capsys, command):
    with pytest.raises(SystemExit) as exit_:
        {"bench": bench, "agreement": agreement}[command].main(bench_args(models, tmp_path, "--device", "gpu"))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"python -m decode.{command}: error: unknown --device 'gpu'" in err


def test_forward_costs_are_measured_once_per_model_and_device(models, cost_cache):
    oracle = GPT2Engine.load(models["oracle"])
    table, cached = costs.measured_costs(models["oracle"], oracle, "float32")
    assert not cached and set(table) == set(costs.PLANNED_COUNTS) and all(ms > 0 for ms in table.values())
    again, cached = costs.measured_costs(models["oracle"], oracle, "float32")
    assert cached and again == table and len(list(cost_cache.iterdir())) == 1
    _, cached = costs.measured_costs(models["oracle"], oracle, "bfloat16")
    assert not cached


def test_forward_costs_keep_a_burst_from_skewing_one_count(monkeypatch):
    """A forward of q nodes takes q ms on a clock the model moves; a burst slows 25 forwards in a row tenfold, as
    other work on the machine would. Timed in rounds, every count's median stays its own."""
    clock = types.SimpleNamespace(ms=0.0, forwards=0)

    class Timed(CachedLM):
        max_length, vocab_size, device, runtime = 1024, 50, torch.device("cpu"), Runtime(torch.device("cpu"), torch.float32)

        def forward(self, token_ids, position_ids, mask, last=None):
            clock.forwards += 1
            clock.ms += len(token_ids) * (10 if 40 <= clock.forwards < 65 else 1)
            self.pending += len(token_ids)

        def commit(self, keep):
            self.length, self.pending = self.length + len(keep), 0

    monkeypatch.setattr(forwards.time, "perf_counter", lambda: clock.ms / 1e3)
    measured = forwards.forward_costs(Timed(), counts=(1, 2, 4, 8), repeats=20)
    assert measured == pytest.approx({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0})


def test_cost_curve_interpolates_and_extrapolates():
    assert costs.cost_curve({1: 1.0, 2: 2.0, 4: 3.0}, 6).tolist() == [0, 1, 2, 2.5, 3, 3.5, 4]


def test_cost_curve_never_falls_with_more_nodes():
    assert costs.cost_curve({1: 2.0, 2: 1.0, 4: 3.0}, 4).tolist() == [0, 1.5, 1.5, 2.25, 3]
    assert costs.non_decreasing([2.54, 2.45, 2.17, 2.24, 2.81]).round(4).tolist() == [2.35, 2.35, 2.35, 2.35, 2.81]


@pytest.mark.parametrize("method, drafting", [("staged", {"trigram trees", "tree building"}),
                                              ("speculative", {"tree building"})])  # a chain's draws are its tree
def test_profile_step_accounts_for_every_part_of_a_step_and_reads_the_prompts_apart(models, tmp_path, monkeypatch, capsys,
                                                                                    method, drafting):
    parts = profile_step.main(bench_args(models, tmp_path, "--method", method))
    assert set(parts) == {"oracle forward", "draft forward", "verification", "rest of the loop"} | drafting
    assert all(ms > 0 for ms in parts.values())
    printed = capsys.readouterr().out
    calls, steps = map(int, re.search(r"(\d+) oracle calls .*?, (\d+) of them steps", printed).groups())
    assert calls - steps == 3  # each of the three prompts read once, at an empty cache
    assert f"step loops in {'C++' if native.module() is not None else 'Python'}" in printed


def test_profile_step_with_concurrency_times_the_steps_of_each_level_and_puts_the_batch_back(models, tmp_path, capsys):
    wrapped = ("run_together", "propose_together", "chain_together")
    originals = {name: getattr(batch_module, name) for name in wrapped}
    out = tmp_path / "steps.json"
    levels = profile_step.main(bench_args(models, tmp_path, "--method", "speculative", "--concurrency", "2,1", "--out", str(out)))
    assert list(levels) == [1, 2]
    assert levels[1]["requests_a_step"] == 1 and 1 < levels[2]["requests_a_step"] <= 2
    for figures in levels.values():
        assert figures["tokens_a_step"] * figures["steps"] == pytest.approx(36)  # 3 prompts x 12 tokens
        assert figures["prompt_steps"] >= 3  # each draft reads its prompt in a step of its own
        assert figures["steps"] == figures["decoding_steps"] + figures["prompt_steps"]
        parts = figures["parts_ms"]
        assert list(parts) == list(batch_steps.PARTS) and all(ms > 0 for ms in parts.values())  # each inside the step
    assert {name: getattr(batch_module, name) for name in wrapped} == originals
    assert re.search(r"requests at once +1 +2\n", capsys.readouterr().out)
    report.main([str(out), "--markdown"])
    table = capsys.readouterr().out
    assert "| requests at once | 1 | 2 |" in table and f"| steps | {levels[1]['steps']} | {levels[2]['steps']} |" in table
    assert all(f"| ms of its {part} |" in table for part in batch_steps.PARTS) and "--concurrency 2,1" in table


def test_timed_steps_puts_the_batch_and_its_module_back_when_what_runs_inside_fails():
    batch, run_together = batch_module.Batch(), batch_module.run_together
    with pytest.raises(RuntimeError), batch_steps.timed_steps(batch):
        assert batch_module.run_together is not run_together and "step" in vars(batch)
        raise RuntimeError("a failing decode")
    assert batch_module.run_together is run_together and "step" not in vars(batch)


def test_timer_asks_a_callable_label_before_each_call():
    watch, state = Timer(), {"label": "a"}
    box = types.SimpleNamespace(work=lambda n: sum(range(n)))
    watch.wrap(box, "work", lambda: state["label"])
    box.work(10)
    state["label"] = "b"
    assert box.work(20) == 190 and box.work(30) == 435
    assert dict(watch.calls) == {"a": 1, "b": 2} and set(watch.seconds) == {"a", "b"}
    with watch.paused():
        box.work(5)
    assert dict(watch.calls) == {"a": 1, "b": 2}
    watch.clear()
    assert not watch.calls and not watch.seconds


@pytest.mark.parametrize("method", ["staged", "speculative", "baseline"])
def test_hooks_time_each_part_of_a_step_from_outside_the_loop_and_change_no_token(models, tmp_path, method):
    decoder = SpeculativeDecoder(run.parse(bench_args(models, tmp_path, "--method", method)).options).decoder
    prompt, timer = Prompt(torch.tensor([5, 9, 14, 3])), Timer()
    for seed, sampling in ((0, Sampling()), (3, Sampling(1.0, 20))):
        alone = decoder(prompt, 12, seed, sampling)
        timer.clear()
        timed = decoder(prompt, 12, seed, sampling, timer.hooks())
        assert timed.tokens == alone.tokens and timed.oracle_calls == alone.oracle_calls
        assert timer.calls["oracle prompt"] + timer.calls["oracle forward"] == timed.oracle_calls
        steps = timed.oracle_calls - (1 if method != "baseline" else 0)  # a speculative loop reads the prompt apart
        assert timer.calls["propose"] == timer.calls["verification"] == (steps if method != "baseline" else 0)
    untimed = Timer().hooks()
    untimed.on_forward = untimed.on_propose = untimed.on_verify = None
    if decoder.drafter is not None:  # a part with no hook is given to the loop as it is
        assert untimed.drafter(decoder.drafter) is decoder.drafter
    assert untimed.run(decoder.oracle) == decoder.oracle.run and untimed.verify(len) is len


def test_transformers_own_deprecation_warning_in_assisted_generation_is_not_shown():
    logger = logging.getLogger("transformers.generation.utils")
    record = lambda message: logger.makeRecord(logger.name, logging.WARNING, __file__, 0, message, (), None)
    own = record("Passing `generation_config` together with generation-related arguments=({'max_new_tokens'}) is deprecated")
    assert peers.without_internal_deprecation in logger.filters
    assert not logger.filter(own) and logger.filter(record("Setting `pad_token_id` to `eos_token_id`"))


@pytest.mark.parametrize("method", ["hf-assisted", "llamacpp-draft"])
def test_bench_refuses_an_assistant_of_another_vocabulary(models, tmp_path, capsys, monkeypatch, method):
    monkeypatch.setenv(llama_server.SERVER_VARIABLE, shutil.which("true"))  # llama.cpp's binary there, the draft wrong
    args = bench_args(models, tmp_path, "--methods", f"baseline,{method}")
    args[args.index("--draft") + 1] = str(models["other_vocab"])
    with pytest.raises(SystemExit) as exit_:
        bench.main(args)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert exit_.value.code == 2 and len(errors) == 1 and "different tokenizers" in errors[0]


def test_bench_engine_times_both_loops_on_the_same_outputs_and_its_graph_section_compares_with_them(models, tmp_path,
                                                                                                    capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"task_id": f"t{i}", "prompt": f"t{i + 2} t{i + 7}"}) + "\n" for i in range(2)))
    oracle = str(models["oracle"])
    argv = ["--model", oracle, "--prompts", str(prompts), "--max-new-tokens", "6", "--repeats", "1",
            "--prefix", "8", "--skip-large"]
    out = bench_engine.main(argv)
    assert out["generation"]["identical_outputs"] == "2/2" and out["dtype"] == "float32"
    assert set(out["host_work_us"]) == {"after a forward", "again"}
    assert set(out["forward_ms"][oracle]) == set(forwards.NODE_COUNTS) and "generation_with_cuda_graphs" not in out
    roofline = out["roofline"]  # the cost curves after each prefix, as the engine runs them, beside the roofline
    assert roofline["bandwidth_gb_s"] > 0 and roofline["peak_gmac_s"] > 0
    assert set(roofline["curves"]) == {f"{oracle} @ {prefix}" for prefix in bench_engine.CURVE_PREFIXES}
    for curve in roofline["curves"].values():
        assert set(curve["roofline_ms"]) == set(curve["ms"]["engine"]) == set(forwards.NODE_COUNTS)
    printed = capsys.readouterr().out
    assert "share of the roofline" in printed and "roofline c(q)/c(1)" in printed
    latency, outputs = bench_engine.generation_latency(oracle, ["t2 t7", "t3 t8"], 6, "float32", "cpu")
    assert [len(tokens) for tokens in outputs] == [6, 6] and latency["identical_outputs"] == "2/2"
    # the GPU's part of the engine benchmark, run where graphs fall back to the eager forward: the same outputs
    args = bench_engine.argparse.Namespace(model=oracle, max_new_tokens=6, dtype="float32", device="cpu",
                                           shapes=[], prefix=8, repeats=1)
    graphed = bench_engine.with_cuda_graphs(args, ["t2 t7", "t3 t8"], latency, outputs,
                                            {oracle: out["forward_ms"][oracle]})
    assert graphed["generation_with_cuda_graphs"]["identical_to_without"] == "2/2"
    assert set(graphed["forward_ms_with_cuda_graphs"][oracle]) == set(forwards.NODE_COUNTS)
    assert "with graphs / without" in capsys.readouterr().out
    compiled = bench_engine.with_cuda_graphs(args, ["t2 t7", "t3 t8"], latency, outputs,
                                             {oracle: out["forward_ms"][oracle]}, compile_layers=True)
    assert compiled["generation_with_compiled_layers"]["identical_to_without"] == "2/2"
    assert set(compiled["forward_ms_with_compiled_layers"][oracle]) == set(forwards.NODE_COUNTS)
    assert "with compiled / without" in capsys.readouterr().out


def test_bench_engine_refuses_a_model_the_lean_engine_does_not_run_with_a_bench_command_that_times_it(models, tmp_path,
                                                                                                       capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = tmp_path / "llama"  # a rope scaling that changes with the sequence's length: transformers' backend runs it
    LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 rope_scaling={"rope_type": "dynamic", "factor": 2.0})).save_pretrained(llama)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(models["oracle"] / name, llama / name)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"task_id": "t0", "prompt": "t2 t7"}) + "\n")
    with pytest.raises(SystemExit):
        bench_engine.main(["--model", str(llama), "--prompts", str(prompts)])
    error = capsys.readouterr().err
    assert "rope type 'dynamic'" in error and "--backend hf" in error
    command = shlex.split(re.search(r"`(python -m decode\.bench [^`]*)`", error)[1])
    known, names, settings = bench.parse(command[3:] + ["--limit", "1", "--max-new-tokens", "2"])
    assert names == ["baseline", "hf-generate"] and settings.flags.base.backend == "hf"
    summary = bench.main(command[3:] + ["--limit", "1", "--max-new-tokens", "2"])["summary"]
    assert summary["hf-generate"]["same_output"]["identical"] == 1


def test_host_work_is_timed_right_after_each_forward_and_again_and_leaves_the_cache_empty(models):
    engine = GPT2Engine.load(models["oracle"])
    seen = []
    forward = engine.forward
    engine.forward = lambda ids, *rest: seen.append((engine.length, ids.numel())) or forward(ids, *rest)
    timings = forwards.host_work_after_forward(engine, prefix=8, repeats=3)
    assert seen == [(0, 8)] + [(8, 1)] * 4  # the prefix, then a first (untimed) and three timed q=1 forwards after it
    assert set(timings) == {"after a forward", "again"} and all(us > 0 for us in timings.values())
    assert engine.length == engine.pending == 0


def test_the_roofline_is_flat_up_to_its_knee_then_grows_with_the_rows():
    from decode.planning.roofline import ForwardShape, Machine, knee

    # float32 weights at 4 GB/s against 8 G multiply-adds a second: a row's 4 bytes a weight take as long as 8 rows'
    # multiply-adds, so the knee is at 8 rows
    gpt2 = lambda element_bytes: ForwardShape(4, 512, 12 * 512 * 512, 512, 8192, element_bytes, element_bytes)
    machine, shape = Machine(bandwidth=4e9, macs=8e9, peak_dtype="float32"), gpt2(4)
    assert knee(shape, machine, cached=0) == 8
    one = shape.roofline_ms(machine, 1, cached=0)
    assert all(shape.roofline_ms(machine, q, cached=0) == pytest.approx(one, rel=0.01) for q in range(1, 8))
    assert shape.roofline_ms(machine, 64, cached=0) == pytest.approx(2 * shape.roofline_ms(machine, 32, cached=0), rel=0.01)
    # bfloat16 halves the bytes, not the arithmetic: the knee comes at half the rows; a long cache adds reads
    assert knee(gpt2(2), machine, cached=0) == 4
    assert shape.roofline_ms(machine, 1, cached=4096) > 1.1 * one


def test_bench_engine_refuses_a_shape_it_cannot_make_in_one_line(models, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_engine.main(["--model", str(models["oracle"]), "--prompts", "humaneval", "--shape", "7,100,50"])
    errors = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(errors) == 1 and "--shape '7,100,50'" in errors[0]


def test_llamacpps_speculation_without_its_server_is_skipped_in_a_line_and_refused_when_named(models, tmp_path, capsys,
                                                                                              monkeypatch):
    monkeypatch.setenv(llama_server.SERVER_VARIABLE, str(tmp_path / "no-llama-server"))
    _, names, _ = bench.parse(bench_args(models, tmp_path))
    assert not set(names) & set(llama_server.SERVER_PEERS)
    skipped = [line for line in capsys.readouterr().out.splitlines() if "llamacpp-draft" in line]
    assert len(skipped) == 1 and skipped[0].startswith("skipping") and "cmake" in skipped[0]
    with pytest.raises(SystemExit) as exit_:
        bench.parse(bench_args(models, tmp_path, "--methods", "baseline,llamacpp-ngram"))
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and "llamacpp-ngram" in error and "cmake --build build --target llama-server" in error


def test_a_llama_server_older_than_the_peers_flags_is_refused_in_a_line_naming_its_version(models, tmp_path, capsys,
                                                                                            monkeypatch):
    old = tmp_path / "llama-server"
    old.write_text('#!/bin/sh\ncase "$1" in --version) echo "version: 1234 (deadbee)";; --help) echo "--model FNAME";; esac\n')
    old.chmod(0o755)
    monkeypatch.setenv(llama_server.SERVER_VARIABLE, str(old))
    with pytest.raises(SystemExit) as exit_:
        bench.main(bench_args(models, tmp_path, "--methods", "baseline,llamacpp-ngram"))
    error = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(error) == 1
    assert "version 1234 (deadbee)" in error[0] and "lacks --spec-type" in error[0] and "cmake" in error[0]


@pytest.mark.parametrize("exit, said_too", [("exit 1", []), ("kill -ILL $$", ["died of SIGILL", "LLAMA_ARG_REPACK=0"])])
def test_a_llama_server_that_exits_at_start_is_reported_in_a_line_with_what_it_said(bpe_run, tmp_path, capsys,
                                                                                    monkeypatch, exit, said_too):
    failing = tmp_path / "llama-server"
    failing.write_text('#!/bin/sh\ncase "$1" in --version) echo "version: 1234 (deadbee)";; --help) echo "--model";; '
                       f'*) echo "error: the model file holds a tensor type this build cannot read"; {exit};; esac\n')
    failing.chmod(0o755)
    monkeypatch.setenv(llama_server.SERVER_VARIABLE, str(failing))
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--run", str(bpe_run["run"]), "--prompts", str(bpe_run["prompts"]), "--limit", "1",
                    "--max-new-tokens", "4", "--dtype", "float32", "--methods", "baseline,llamacpp-server"])
    said = capsys.readouterr().err
    error = said.strip().splitlines()[-1]
    assert exit_.value.code == 2 and "Traceback" not in said
    assert "did not start" in error and "a tensor type this build cannot read" in error
    assert all(words in error for words in said_too) and ("died of" in error) == bool(said_too)


@pytest.mark.parametrize("features, recorded", [
    ("AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | LLAMAFILE = 1 | OPENMP = 1", "for AVX2"),
    ("AVX = 1 | AVX2 = 1 | F16C = 1 | AVX512 = 1 | AVX512_VBMI = 0 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1",
     "for AVX512, AVX512_VNNI, AVX512_BF16, AMX_INT8"),
    ("SSE3 = 1 | SSSE3 = 1", ""),
])
def test_a_result_records_the_instructions_llama_cpp_was_built_for(tmp_path, monkeypatch, features, recorded):
    for name in [name for name in os.environ if name.startswith("LLAMA_ARG_")]:  # (the build line records them: tested below)
        monkeypatch.delenv(name)
    server = tmp_path / "llama-server"
    server.write_text('#!/bin/sh\ncase "$1" in --version) echo "version: 1234 (deadbee)";; '
                      f'-m) echo "0.00.002.806 I cmn  common_param: system_info: n_threads = 2 | CPU : {features} |"; '
                      'exit 1;; esac\n')
    server.chmod(0o755)
    assert llama_server.server_build(str(server)) == "1234 (deadbee)" + (f" {recorded}" if recorded else "")


def test_a_result_records_the_settings_llama_server_reads_from_the_environment(tmp_path, monkeypatch):
    server = tmp_path / "llama-server"
    server.write_text('#!/bin/sh\ncase "$1" in --version) echo "version: 1234 (deadbee)";; esac\n')
    server.chmod(0o755)
    monkeypatch.setenv("LLAMA_ARG_REPACK", "0")
    assert llama_server.server_build(str(server)) == "1234 (deadbee) with LLAMA_ARG_REPACK=0"


@pytest.mark.processes
def test_llamacpps_own_speculation_decodes_the_baselines_tokens(bpe_run, tmp_path, capsys):
    """llama.cpp's plain decoding, draft-model and n-gram speculation through llama-server, each speculation at the
    setting that ran fastest on the first prompts (said in a line), give the baseline's greedy tokens, healed prompts
    included; each server's peak resident memory is reported beside this process's."""
    if llama_server.server_binary() is None:
        pytest.skip(f"no llama-server here: {llama_server.missing_reason()}")
    result = bench.main(["--run", str(bpe_run["run"]), "--prompts", str(bpe_run["prompts"]), "--limit", "4",
                         "--max-new-tokens", "16", "--dtype", "float32", "--methods",
                         "baseline," + ",".join(llama_server.SERVER_PEERS)])
    printed = capsys.readouterr().out
    for name in llama_server.SERVER_PEERS:
        same = result["summary"][name]["same_output"]
        assert same["identical"] + len(same["near_ties"]) == 4 and not same["differences"], (name, same)
        flags = result["settings"]["llamacpp_flags"][name]
        assert flags in {" ".join(f) for f in llama_server.CANDIDATES[name]}
        assert (f"{name}: {flags} (fastest on" in printed) == (len(llama_server.CANDIDATES[name]) > 1)
        assert result["summary"][name]["peak_rss_mb"] > 0 and f"{name}'s server" in printed
    assert result["settings"]["peak_rss_mb"] > 0 and "peak resident memory: this process" in printed
    assert " for AVX" in result["settings"]["llama_server"]  # the instructions its CPU backend was built for



def test_profile_step_offers_no_output_flag_it_would_ignore(capsys, tmp_path):
    with pytest.raises(SystemExit) as refused:
        profile_step.main(["--oracle", "x", "--prompt", "t1", "--stream"])
    assert refused.value.code == 2 and "unrecognized arguments: --stream" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:  # --out writes the profile of many requests at once only
        profile_step.main(["--oracle", "x", "--prompt", "t1", "--out", str(tmp_path / "profile.json")])
    assert refused.value.code == 2 and "add --concurrency" in capsys.readouterr().err
    assert not (tmp_path / "profile.json").exists()


def test_profile_start_times_fresh_processes_to_the_models_loaded_the_first_token_and_the_exit(models, tmp_path, capsys):
    out = tmp_path / "start.json"
    args = ["--oracle", str(models["oracle"]), "--draft", str(models["draft"]), "--ngram", str(models["ngram"]),
            "--prompt", "t3 t9 t4", "--max-new-tokens", "8", "--repeats", "1", "--out", str(out)]
    result = profile_start.main(args)
    floor, command = (result["startup"][name]["median"] for name in ("floor", "command"))
    assert floor["loaded"] is None and floor["first_token"] is None and floor["exit"] > 0
    assert 0 < command["loaded"] <= command["first_token"] <= command["exit"]
    assert command["peak_rss_mb"] > floor["peak_rss_mb"] > 0  # decode.run imports torch and more
    assert json.loads(out.read_text())["settings"]["decoding"].endswith("--prompt 't3 t9 t4' --stream")
    capsys.readouterr()
    report.main([str(out), "--markdown"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| `python")]
    assert len(rows) == 2 and "import torch" in rows[0] and "decode.run" in rows[1]
    with pytest.raises(SystemExit) as exit_info:  # decode.run's own flags are checked before any process starts
        profile_start.main([*args[:-2], "--method", "nosuch"])
    assert exit_info.value.code == 2 and "invalid choice" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as exit_info:  # what only decode.run finds out: its one line, in one line
        profile_start.main(["--run", str(tmp_path / "empty"), "--prompt", "t3", "--repeats", "1"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert exit_info.value.code == 2 and len(errors) == 1 and "oracle directory" in errors[0]


def test_the_run_names_the_drafts_block_format_per_method_where_the_plans_differ_and_the_peer_drafts_in_speculatives(
        models):
    def decoder(method: str, draft_dtype: str | None = None) -> Decoder:
        return SpeculativeDecoder.from_pretrained(models["oracle"], models["draft"], ngram=models["ngram"], method=method,
                                                  draft_dtype=draft_dtype).decoder

    mixed = {"baseline": decoder("baseline"), "speculative": decoder("speculative", "q8_0"),
             "staged": decoder("staged", "float32")}
    assert bench.weight_formats(mixed) == {"oracle": None, "draft": "q8_0 for speculative"}
    assert bench.peer_draft_format(mixed) == "q8_0"
    assert [bench.draft_of(d.draft)["dtype"] for d in mixed.values() if d.draft is not None] == ["q8_0", "float32"]
    alike = mixed | {"staged": decoder("staged", "q8_0")}
    assert bench.weight_formats(alike) == {"oracle": None, "draft": "q8_0"}
    unquantized = {"baseline": mixed["baseline"], "staged": mixed["staged"]}
    assert bench.weight_formats(unquantized) == {"oracle": None, "draft": None}
    assert bench.peer_draft_format(unquantized) is None


@pytest.mark.parametrize("draft_dtype, exported", [(None, None), ("q8_0", "q8_0")])
def test_llamacpp_draft_is_given_the_blocks_our_draft_was_quantized_to_as_it_loaded(models, tmp_path, monkeypatch,
                                                                                     draft_dtype, exported):
    class Exported(Exception):
        pass

    def server_peer(name, oracle_dir, draft_dir, sampling, eos_id, dtype, threads, context, draft_format=None):
        raise Exported(name, dtype, draft_format)

    monkeypatch.setattr(bench, "ServerPeer", server_peer)
    found = tmp_path / "llama-server"  # a binary to find: the peer itself is the stand-in above
    found.write_text("#!/bin/sh\n")
    found.chmod(0o755)
    monkeypatch.setenv(llama_server.SERVER_VARIABLE, str(found))
    typed = ["--draft-dtype", draft_dtype] if draft_dtype else []
    with pytest.raises(Exported) as peer:
        bench.main(bench_args(models, tmp_path, "--methods", "baseline,speculative,llamacpp-draft", "--limit", "1", *typed))
    assert peer.value.args == ("llamacpp-draft", "float32", exported)
