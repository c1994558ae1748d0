"""The Python API: generate and stream equal the command line and the baseline; bad arguments are InputErrors."""
import json

import pytest

from decode import SpeculativeDecoder
from decode.cli import run
from decode.errors import InputError

METHODS = {"baseline": {}, "speculative": {}, "tree": {"budget": 12}, "staged": {"budget": 16, "widths": [4, 2, 1]},
           "ngram": {"budget": 16, "widths": [4, 2, 1]}, "lookup": {}}
FLAGS = {"budget": "--budget", "widths": "--widths"}
TEXTS = ["def scale(values):\n", "s = '日本語のテキスト'  # 🙂 emoji 🐍\n", "🙂🙂", "print('héllo wörld')"]


@pytest.fixture(scope="module")
def decoders(bpe_run):
    return {method: SpeculativeDecoder.from_run(bpe_run["run"], method=method, **extra) for method, extra in METHODS.items()}


@pytest.mark.parametrize("method", METHODS)
def test_generate_equals_the_command_line_and_the_baseline(bpe_run, decoders, method):
    flags = [x for key, value in METHODS[method].items() for x in (FLAGS[key], ",".join(map(str, value)) if isinstance(value, list) else str(value))]
    records = run.main(["--run", str(bpe_run["run"]), "--prompts", str(bpe_run["prompts"]), "--max-new-tokens", "16",
                        "--method", method, *flags])
    prompts = bpe_run["prompts"].read_text().splitlines()
    for i, record in enumerate(records):
        text = json.loads(prompts[i])["prompt"]
        result = decoders[method].generate(text, max_new_tokens=16, seed=i)
        assert (result.text, result.token_ids, result.healed) == (record["completion"], record["token_ids"], record["healed"])
        assert result.token_ids == decoders["baseline"].generate(text, max_new_tokens=16, seed=i).token_ids
        assert result.oracle_calls == record["oracle_calls"] and result.seconds > 0


@pytest.mark.parametrize("method", ["baseline", "staged", "lookup"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.5}])
def test_streamed_pieces_join_to_the_generated_text(decoders, method, sampling):
    dec = decoders[method]
    partial = 0
    for text in TEXTS:
        for seed in range(4):
            pieces = list(dec.stream(text, max_new_tokens=24, seed=seed, **sampling))
            result = dec.generate(text, max_new_tokens=24, seed=seed, **sampling)
            assert "".join(pieces) == result.text
            assert all(pieces) and all(not p.endswith("\ufffd") for p in pieces[:-1])
            ids = dec.tokenizer(text, add_special_tokens=False).input_ids
            partial += any(dec.tokenizer.decode(ids + result.token_ids[:n]).endswith("\ufffd") for n in range(1, len(result.token_ids)))
    if sampling:  # random bytes from a byte-level vocabulary: some outputs pass through half a character
        assert partial


def test_token_ids_are_prompts_too(decoders):
    dec = decoders["staged"]
    ids = dec.tokenizer("def scale(values):\n", add_special_tokens=False).input_ids
    assert dec.generate(ids, max_new_tokens=10).token_ids == dec.generate("def scale(values):\n", max_new_tokens=10).token_ids


def test_sampling_settings_are_per_call(decoders):
    dec = decoders["staged"]
    greedy = dec.generate("import math\n", max_new_tokens=20).token_ids
    sampled = [dec.generate("import math\n", max_new_tokens=20, temperature=2.0, top_k=50, top_p=0.95, seed=s).token_ids for s in range(3)]
    assert any(s != greedy for s in sampled)
    assert dec.generate("import math\n", max_new_tokens=20).token_ids == greedy  # back to greedy


def test_bad_arguments_are_input_errors(bpe_run, decoders):
    dec = decoders["staged"]
    cases = [
        (lambda: dec.generate("x", max_new_tokens=0), "max_new_tokens must be at least 1"),
        (lambda: dec.generate("", max_new_tokens=4), "is empty"),
        (lambda: dec.generate("x", max_new_tokens=4, temperature=-1), "temperature must be 0 (greedy) or a finite"),
        (lambda: dec.generate("x", max_new_tokens=4, temperature=float("nan")), "or a finite number of at least"),
        (lambda: dec.generate("x", max_new_tokens=4, temperature=float("inf")), "or a finite number of at least"),
        (lambda: dec.generate("x", max_new_tokens=4, temperature=1e-300), "of at least 0.0001 (got 1e-300)"),
        (lambda: dec.generate("x", max_new_tokens=4, temperature=1, seed=2**64), "seed must lie in"),
        (lambda: dec.generate("x", max_new_tokens=4, seed=-(2**70)), "seed must lie in"),
        (lambda: dec.generate("x = '\ud800'\n", max_new_tokens=4), "prompt holds a lone surrogate (U+D800"),
        (lambda: dec.generate("x", max_new_tokens=4, top_p=0), "top-p must lie in (0, 1]"),
        (lambda: dec.generate([1, 10**6], max_new_tokens=4), "token ids must lie in"),
        (lambda: dec.generate(3.5, max_new_tokens=4), "a string or a list of token ids"),
        (lambda: dec.generate("x", max_new_tokens=10**5), "does not fit the context"),
        (lambda: SpeculativeDecoder.from_run(bpe_run["run"], method="medusa"), "unknown method 'medusa'"),
        (lambda: SpeculativeDecoder.from_run(bpe_run["run"], beams=4), "unknown options ['beams']"),
        (lambda: SpeculativeDecoder.from_run(bpe_run["run"], device="gpu"), "unknown --device 'gpu'"),
        (lambda: SpeculativeDecoder.from_run(bpe_run["run"], draft_dtype="float16"), "draft_dtype must be float32, bfloat16, q8_0 or q4_0"),
        (lambda: SpeculativeDecoder.from_run(bpe_run["run"], budget=1), "--budget 1 is out of range"),
        (lambda: SpeculativeDecoder.from_run(bpe_run["run"], widths=[8, 8, 8, 8]), "a trigram tree of 4,681 nodes"),
        (lambda: SpeculativeDecoder.from_run(bpe_run["run"] / "nothing"), "does not exist"),
        (lambda: SpeculativeDecoder.from_run(), "pass a run directory"),
        (lambda: dec.generate("x", max_new_tokens=4, stop_strings=123), "stop_strings must be a non-empty string"),
        (lambda: dec.generate("x", max_new_tokens=4, do_sample="no"), "do_sample must be True or False (got 'no')"),
        (lambda: SpeculativeDecoder.from_run(bpe_run["run"], budget="12"), "budget must be an integer (got '12')"),
        (lambda: SpeculativeDecoder.from_run(bpe_run["run"], widths="3,2,1"), "widths must be a list of integers"),
        (lambda: SpeculativeDecoder.from_run(bpe_run["run"], token_healing="no"), "token_healing must be True or False"),
        (lambda: SpeculativeDecoder.from_pretrained(bpe_run["run"] / "oracle", tokenizer="x"), "must be a loaded tokenizer"),
    ]
    for call, message in cases:
        with pytest.raises(InputError) as err:
            call()
        assert message in str(err.value) and "\n" not in str(err.value)


def test_run_stream_prints_the_completion_as_generated(bpe_run, decoders, capsys):
    text = TEXTS[1]
    records = run.main(["--run", str(bpe_run["run"]), "--prompt", text, "--max-new-tokens", "24", "--method", "lookup",
                        "--stream", "--temperature", "1.5", "--seed", "3"])
    printed = capsys.readouterr().out
    assert printed.startswith(text + records[0]["completion"] + "\n")
    assert records[0]["completion"] == decoders["lookup"].generate(text, max_new_tokens=24, temperature=1.5, seed=3).text
