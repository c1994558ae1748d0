"""Token healing on a byte-level BPE run: the prompt's trailing token is backed off, the first new
token must extend its text, and every method gives the baseline's output under that constraint."""
import pytest
import torch
from decode_models import PROMPTS
from transformers import GPT2LMHeadModel

from decode.cli import run
from decode.healing import TokenHealer


def test_a_trailing_newline_is_backed_off_and_only_its_extensions_may_follow(bpe_run):
    tokenizer = bpe_run["tokenizer"]
    healer = TokenHealer(tokenizer, len(tokenizer))
    ids = tokenizer(PROMPTS[2], add_special_tokens=False).input_ids
    assert tokenizer.decode(ids[-1:]) == "\n"  # the bare newline token training never ends a line with
    prompt = healer(ids)
    assert prompt.ids.tolist() == ids[:-1] and prompt.tail == "\n"
    extends = [not tokenizer.decode([i]).startswith("<|") and tokenizer.decode([i]).startswith("\n") for i in range(len(tokenizer))]
    assert prompt.allowed.tolist() == extends and sum(extends) > 1  # "\n" and "\n" + indentation, at least
    assert TokenHealer(tokenizer, len(tokenizer), enabled=False)(ids).allowed is None
    one = tokenizer("x", add_special_tokens=False).input_ids
    assert healer(one).ids.tolist() == one and healer(one).allowed is None  # nothing would be left to feed


@pytest.mark.parametrize("method, extra", [("speculative", []), ("tree", ["--budget", "12"]),
                                           ("staged", ["--budget", "16", "--widths", "4,2,1"]),
                                           ("ngram", ["--budget", "16", "--widths", "4,2,1"]), ("lookup", [])])
def test_greedy_first_token_is_the_oracles_best_extension_in_every_method(bpe_run, tmp_path, method, extra):
    common = ["--run", str(bpe_run["run"]), "--prompts", str(bpe_run["prompts"]), "--max-new-tokens", "12"]
    base = run.main(common + ["--method", "baseline"])
    assert [r["token_ids"] for r in run.main(common + ["--method", method, *extra])] == [r["token_ids"] for r in base]
    tokenizer, hf = bpe_run["tokenizer"], GPT2LMHeadModel.from_pretrained(bpe_run["run"] / "oracle").eval()
    healed = 0
    for text, record in zip(PROMPTS, base):
        ids = tokenizer(text, add_special_tokens=False).input_ids
        tail = tokenizer.decode(ids[-1:])
        with torch.no_grad():
            logits = hf(torch.tensor([ids[:-1]])).logits[0, -1]
        extends = torch.tensor([tokenizer.decode([i]).startswith(tail) and i != tokenizer.eos_token_id
                                for i in range(len(tokenizer))])
        assert record["token_ids"][0] == int(logits.masked_fill(~extends, float("-inf")).argmax())
        assert record["healed"] == tail
        assert text + record["completion"] == tokenizer.decode(ids[:-1] + record["token_ids"])
        healed += tokenizer.decode(record["token_ids"][:1]) != tail  # the first token is longer than the tail
    assert healed  # the constraint did more than repeat the backed-off token


def test_without_healing_the_prompt_is_fed_whole(bpe_run):
    common = ["--run", str(bpe_run["run"]), "--prompts", str(bpe_run["prompts"]), "--max-new-tokens", "6", "--method", "baseline"]
    tokenizer, hf = bpe_run["tokenizer"], GPT2LMHeadModel.from_pretrained(bpe_run["run"] / "oracle").eval()
    for text, record in zip(PROMPTS, run.main(common + ["--no-token-healing"])):
        ids = tokenizer(text, add_special_tokens=False).input_ids
        with torch.no_grad():
            assert record["token_ids"][0] == int(hf(torch.tensor([ids])).logits[0, -1].argmax())
        assert record["healed"] == ""
