"""The decoder shaped like transformers: from_pretrained takes a directory, a hub name or a loaded model; generate
takes a GenerationConfig, do_sample, eos_token_id, stop_strings and streamer=, and stops as transformers' own
generate stops on the same oracle."""
import io
import threading
from contextlib import redirect_stdout

import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig, TextIteratorStreamer, TextStreamer

from decode import SpeculativeDecoder
from decode.errors import InputError
from decode.models.pretrained import load_causal_lm

PROMPT = "def scale(values):\n    return"  # ends inside a line: no token to heal, so transformers sees the same ids


@pytest.fixture(scope="module")
def models(bpe_run):
    run = bpe_run["run"]
    staged = SpeculativeDecoder.from_pretrained(run / "oracle", run / "draft", run / "ngram", token_healing=False)
    hf = load_causal_lm(run / "oracle", "oracle").eval()
    tokenizer = AutoTokenizer.from_pretrained(run / "oracle")
    return staged, hf, tokenizer


def transformers_tokens(hf, tok, **settings) -> list[int]:
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=tok.eos_token_id,
                          **settings)
    return out[0, ids.shape[1]:].tolist()


def test_greedy_tokens_are_transformers_generates(models):
    staged, hf, tokenizer = models
    assert staged.options.method == "staged"
    ours = staged.generate(PROMPT, max_new_tokens=24)
    assert ours.token_ids == transformers_tokens(hf, tokenizer, max_new_tokens=24)
    assert staged.generate(PROMPT, GenerationConfig(max_new_tokens=24, do_sample=False)).token_ids == ours.token_ids
    assert ours.finish_reason == ("stop" if len(ours.token_ids) < 24 else "length")


def test_eos_token_id_stops_where_transformers_stops(models):
    staged, hf, tokenizer = models
    free = staged.generate(PROMPT, max_new_tokens=24).token_ids
    eos = free[5]  # a token the greedy output reaches: both stop after its first occurrence, keeping it
    ours = staged.generate(PROMPT, max_new_tokens=24, eos_token_id=eos)
    assert ours.token_ids == transformers_tokens(hf, tokenizer, max_new_tokens=24, eos_token_id=eos)
    assert ours.token_ids[-1] == eos and eos not in ours.token_ids[:-1] and ours.finish_reason == "stop"
    config = GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=[eos, free[9]])
    assert staged.generate(PROMPT, config).token_ids == ours.token_ids


def test_stop_strings_stop_where_transformers_stops(models):
    staged, hf, tokenizer = models
    free = staged.generate(PROMPT, max_new_tokens=24)
    texts = [tokenizer.decode([t]) for t in free.token_ids]
    stop = next(t.strip() for t in texts[3:] if t.strip().isascii() and t.strip().isprintable() and t.strip())
    ours = staged.generate(PROMPT, max_new_tokens=24, stop_strings=[stop])
    assert ours.token_ids == transformers_tokens(hf, tokenizer, max_new_tokens=24, stop_strings=[stop], tokenizer=tokenizer)
    assert stop in ours.text and ours.finish_reason == "stop" and len(ours.token_ids) < len(free.token_ids)
    assert stop not in staged.tokenizer.decode(ours.token_ids[:-1])  # the token that completes it ends the output


def test_transformers_streamers_work_unchanged(models):
    staged, _, tokenizer = models
    expected = staged.generate(PROMPT, max_new_tokens=24).text
    printed = io.StringIO()
    with redirect_stdout(printed):
        staged.generate(PROMPT, max_new_tokens=24, streamer=TextStreamer(tokenizer, skip_prompt=True))
    assert printed.getvalue().rstrip("\n") == expected.rstrip("\n")
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    thread = threading.Thread(target=staged.generate, args=(PROMPT,), kwargs={"max_new_tokens": 24, "streamer": streamer})
    thread.start()
    assert "".join(streamer) == expected
    thread.join()


def test_sampling_without_a_seed_is_fresh_and_with_one_reproducible(models):
    staged, _, _ = models
    draws = {tuple(staged.generate(PROMPT, max_new_tokens=24, temperature=1.5).token_ids) for _ in range(4)}
    assert len(draws) > 1
    seeded = [staged.generate(PROMPT, max_new_tokens=24, do_sample=True, temperature=1.5, seed=7).token_ids for _ in range(2)]
    assert seeded[0] == seeded[1]
    assert staged.generate(PROMPT, max_new_tokens=24, do_sample=False, temperature=1.5).token_ids == \
        staged.generate(PROMPT, max_new_tokens=24).token_ids  # do_sample=False is greedy, as in transformers


def test_a_stream_gives_its_result(models):
    staged, _, _ = models
    expected = staged.generate(PROMPT, max_new_tokens=24)
    stream = staged.stream(PROMPT, max_new_tokens=24)
    assert stream.result is None
    assert "".join(stream) == expected.text
    assert stream.result.token_ids == expected.token_ids and stream.result.oracle_calls == expected.oracle_calls
    assert stream.result.seconds > 0


def test_from_pretrained_takes_a_loaded_model_and_refuses_what_it_cannot_load(bpe_run, models, monkeypatch):
    staged, hf, tokenizer = models
    loaded = SpeculativeDecoder.from_pretrained(hf, tokenizer=tokenizer, token_healing=False)
    assert loaded.options.method == "baseline"
    assert loaded.generate(PROMPT, max_new_tokens=24).token_ids == staged.generate(PROMPT, max_new_tokens=24).token_ids
    with pytest.raises(InputError, match="needs its tokenizer"):
        SpeculativeDecoder.from_pretrained(hf)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(InputError, match="is not a directory, and the hub name is not in the local cache"):
        SpeculativeDecoder.from_pretrained("no-such-user/no-such-model")
    with pytest.raises(InputError, match="unknown generation settings"):
        staged.generate(PROMPT, num_beams=4)
