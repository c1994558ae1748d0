"""A decoder used by several callers, and the last bad inputs: each refused at once in one line, nothing corrupted."""
import gzip
import shutil
import threading

import pytest
from test_outputs import one_line_error

from decode import DecoderBusy, SpeculativeDecoder
from decode.cli import flags, run
from decode.errors import InputError
from decode.methods import METHODS
from decode.models import precision
from decode.prompts import load_prompts
from decode.tokenizer import load_tokenizer

PROMPT = "def scale(values):\n"


@pytest.fixture(scope="module")
def staged(bpe_run):
    decoder = SpeculativeDecoder.from_run(bpe_run["run"], method="staged")
    baseline = SpeculativeDecoder.from_run(bpe_run["run"], method="baseline")
    return decoder, baseline.generate(PROMPT, max_new_tokens=24)


def test_a_second_caller_is_refused_at_once_and_the_first_decodes_on(staged):
    decoder, expected_result = staged
    expected = expected_result.token_ids
    first = decoder.stream(PROMPT, max_new_tokens=24)
    text = next(first)
    second = decoder.stream("import os\n", max_new_tokens=8)
    with pytest.raises(DecoderBusy, match="already decoding"):
        next(second)
    with pytest.raises(DecoderBusy):
        decoder.generate(PROMPT, max_new_tokens=4)
    text += "".join(first)  # the first stream goes on unharmed
    assert text == expected_result.text
    assert decoder.generate(PROMPT, max_new_tokens=24).token_ids == expected


def test_a_stream_closed_early_frees_the_decoder(staged):
    decoder, expected_result = staged
    expected = expected_result.token_ids
    stream = decoder.stream(PROMPT, max_new_tokens=24)
    next(stream)
    stream.close()
    assert decoder.generate(PROMPT, max_new_tokens=24).token_ids == expected


def test_threads_sharing_a_decoder_take_turns_or_are_refused_and_state_survives(staged):
    decoder, expected_result = staged
    expected = expected_result.token_ids
    inside, release = threading.Event(), threading.Event()
    outcomes = {}

    def holder():
        pieces = decoder.stream(PROMPT, max_new_tokens=24)
        text = next(pieces)
        inside.set()
        release.wait(timeout=30)
        outcomes["holder"] = text + "".join(pieces)

    def intruder():
        inside.wait(timeout=30)
        try:
            decoder.generate("import os\n", max_new_tokens=8)
            outcomes["intruder"] = "decoded"
        except DecoderBusy as err:
            outcomes["intruder"] = str(err)
        release.set()

    threads = [threading.Thread(target=holder), threading.Thread(target=intruder)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert "already decoding" in outcomes["intruder"] and "\n" not in outcomes["intruder"]
    assert outcomes["holder"] == expected_result.text
    # many threads at once: each either decodes the baseline's tokens or is refused; afterwards all is well
    results = []
    workers = [threading.Thread(target=lambda: results.append(attempt(decoder))) for _ in range(6)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    assert len(results) == 6 and all(r in ("busy", tuple(expected)) for r in results) and tuple(expected) in results
    assert decoder.generate(PROMPT, max_new_tokens=24).token_ids == expected


def attempt(decoder):
    try:
        return tuple(decoder.generate(PROMPT, max_new_tokens=24).token_ids)
    except DecoderBusy:
        return "busy"


@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": "4"}, "max_new_tokens must be an integer (got '4')"),
    ({"max_new_tokens": 4.0}, "max_new_tokens must be an integer"),
    ({"max_new_tokens": [4]}, "max_new_tokens must be an integer"),
    ({"max_new_tokens": 4, "temperature": "1"}, "temperature must be a number"),
    ({"max_new_tokens": 4, "top_k": 2.5}, "top_k must be an integer"),
    ({"max_new_tokens": 4, "seed": "0"}, "seed must be an integer"),
])
def test_settings_of_the_wrong_type_are_input_errors(staged, kwargs, message):
    decoder, expected_result = staged
    expected = expected_result.token_ids
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        decoder.generate(PROMPT, **kwargs)
    assert decoder.generate(PROMPT, max_new_tokens=24).token_ids == expected  # the refusal freed the decoder


def test_a_damaged_gzip_prompts_file_is_a_one_line_error(bpe_run, tmp_path, capsys):
    path = tmp_path / "prompts.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"task_id": "a", "prompt": "x"}\n')[:10] + b"garbage after the header" * 4)
    with pytest.raises(InputError, match=f"cannot read prompts file {path}"):
        load_prompts(str(path))
    line = one_line_error(capsys, run.main, ["--run", str(bpe_run["run"]), "--prompts", str(path)])
    assert str(path) in line and "gzipped" in line


def test_a_model_directory_without_its_tokenizer_files_is_refused(bpe_run, tmp_path, capsys):
    oracle = tmp_path / "oracle"
    shutil.copytree(bpe_run["run"] / "oracle", oracle)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"):
        (oracle / name).unlink(missing_ok=True)
    with pytest.raises(InputError, match="tokenizer"):
        load_tokenizer(oracle)
    with pytest.raises(InputError, match="^tokenizer directory '.*nowhere' does not exist"):
        load_tokenizer(tmp_path / "nowhere")
    with pytest.raises(InputError, match=str(oracle)):
        SpeculativeDecoder.from_run(oracle=oracle, method="baseline")
    line = one_line_error(capsys, run.main, ["--oracle", str(oracle), "--method", "baseline", "--prompt", "x"])
    assert str(oracle) in line and "tokenizer" in line


def test_a_trigram_directory_without_meta_json_is_refused(bpe_run, tmp_path, capsys):
    ngram = tmp_path / "ngram"
    shutil.copytree(bpe_run["run"] / "ngram", ngram)
    (ngram / "meta.json").unlink()
    with pytest.raises(InputError, match="has no meta.json"):
        SpeculativeDecoder.from_run(bpe_run["run"], ngram=ngram, method="staged")
    line = one_line_error(capsys, run.main, ["--run", str(bpe_run["run"]), "--ngram", str(ngram), "--method", "ngram",
                                             "--prompt", "x"])
    assert "has no meta.json" in line and "build_katz" in line
    (ngram / "meta.json").write_text('{"vocab_size": 7, "eos_id": 0}')
    with pytest.raises(InputError, match="says a vocabulary of 7 tokens"):
        SpeculativeDecoder.from_run(bpe_run["run"], ngram=ngram, method="staged")


def test_auto_dtype_times_the_oracle_once_and_picks_the_faster(bpe_run, tmp_path, monkeypatch):
    monkeypatch.delenv(precision.PINNED)
    timed = []

    def fake(oracle, dtype, device):
        timed.append(dtype)
        return {1: 3.0, 16: 5.0} if dtype == "bfloat16" else {1: 4.8, 16: 9.1}

    monkeypatch.setattr(precision, "time_forwards", fake)
    dtype, why = precision.measured_dtype(bpe_run["run"] / "oracle", "cpu", cache_dir=tmp_path)
    assert dtype == "bfloat16" and "bfloat16 3.00 + 5.00 ms" in why and "float32 4.80 + 9.10 ms" in why
    assert precision.measured_dtype(bpe_run["run"] / "oracle", "cpu", cache_dir=tmp_path) == (dtype, why)
    assert sorted(timed) == ["bfloat16", "float32"]  # measured once, then read back
    monkeypatch.setattr(precision, "time_forwards", lambda o, dtype, d: {1: 1.0, 16: 2.0} if dtype == "float32" else {1: 9.0, 16: 9.0})
    assert precision.measured_dtype(bpe_run["run"] / "oracle", "cpu", cache_dir=tmp_path / "other")[0] == "float32"


def test_only_calibration_measures_and_the_command_line_says_what_auto_dtype_took(bpe_run, tmp_path, monkeypatch,
                                                                                     capsys):
    from decode.cli import calibrate
    from decode.models import native_rows, projection

    monkeypatch.delenv(precision.PINNED)
    for module in (precision, projection, native_rows):
        monkeypatch.setattr(module, "CACHE_DIR", tmp_path)
    said = lambda: [line for line in capsys.readouterr().err.splitlines() if line.startswith("dtype:")]
    argv = ["--run", str(bpe_run["run"]), "--method", "baseline", "--prompt", "x", "--no-plan"]
    flags.announce.cache_clear()  # said once per process: this test reads it
    run.parse(argv)
    assert len(line := said()) == 1 and "not calibrated: `python -m decode.calibrate` times both" in line[0]
    run.main(argv + ["--max-new-tokens", "8"])
    assert not list(tmp_path.iterdir())  # checking, loading and decoding timed nothing
    with pytest.raises(SystemExit) as refused:
        calibrate.main(["--run", str(tmp_path / "no-run")])
    assert refused.value.code == 2 and "oracle directory" in capsys.readouterr().err
    chosen = calibrate.main(["--run", str(bpe_run["run"])])
    kept = {p.name.split("-")[0] for p in tmp_path.iterdir()}
    assert {"dtype", "layout", "native"} <= kept and set(chosen) == {"oracle", "draft"}
    flags.announce.cache_clear()
    said()
    settings = run.parse(argv)
    assert len(line := said()) == 1 and line[0].startswith(f"dtype: {settings.options.dtype} (measured faster here")
    assert run.parse(["--run", str(bpe_run["run"]), "--prompt", "x", "--dtype", "float32"]).options.dtype == "float32"


def test_every_option_is_a_flag_with_its_help_and_only_the_planned_ones_wait_for_a_plan():
    """The flags, their help and what a plan may fill come from DecoderOptions' fields (decode.options.setting)."""
    import argparse
    import dataclasses

    from decode import plan_file
    from decode.options import DecoderOptions

    parser = argparse.ArgumentParser()
    flags.add_decoder_flags(parser)
    actions = {action.dest: action for action in parser._actions}
    for field in dataclasses.fields(DecoderOptions):
        if "help" not in field.metadata:  # what a plan or the library sets: no flag
            assert field.name in ("tree_shape", "policy") and field.name not in actions
            continue
        action = actions[field.name]
        assert action.option_strings[0] == f"--{field.name.replace('_', '-')}"
        assert field.name == "method" or action.help.startswith(field.metadata["help"])
        unset = field.metadata["planned"] or field.name == "method"  # the method: the device and the plan decide it
        assert action.default == (None if unset else field.default)
        assert action.choices == (list(METHODS) if field.name == "method" else field.metadata["flag"].get("choices"))
    assert set(flags.PLANNED_FLAGS) == plan_file.PLANNED == {"k", "budget", "depth", "widths", "branch", "draft_calls",
                                                              "lookup_tokens", "draft_dtype", "draft_vocab"}
    with pytest.raises(InputError, match="backend must be auto, lean or hf"):
        DecoderOptions("oracle", backend="fast").check()
