"""A completion's text decoded as its tokens grow is the whole decode's at every step, on each kind of tokenizer
users' models ship: byte-level BPE (GPT-2, Llama 3, Qwen2), SentencePiece BPE with byte fallback (Llama 2, Mistral:
a text's first space stripped, characters split into byte tokens) and WordPiece with its spaces cleaned up."""
import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers import models as tokenizer_models
from transformers import PreTrainedTokenizerFast

from decode.completion_text import CompletionText
from decode.healing import Prompt


def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """Llama 2's kind: "▁" for a space, the 256 bytes as <0xNN> tokens, and a decoder that drops the text's first
    space."""
    pieces = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], "▁", "▁def", "▁return", "x", "(", "):",
              "é", "▁é", "ab", "▁ab", "日本"]
    backend = Tokenizer(tokenizer_models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>",
                                             byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def wordpiece_tokenizer() -> PreTrainedTokenizerFast:
    """WordPiece, whose decode joins words with spaces and then removes those before punctuation."""
    words = ["[UNK]", "[SEP]", "def", "f", "return", "x", "##y", "##z", ".", ",", "?", "!", "'", "s", "n't", "do"]
    backend = Tokenizer(tokenizer_models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(cleanup=True)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", sep_token="[SEP]",
                                   clean_up_tokenization_spaces=True)


def byte_level_tokenizer(bpe_run) -> PreTrainedTokenizerFast:
    return bpe_run["tokenizer"]


@pytest.mark.parametrize("make", [byte_level_tokenizer, sentencepiece_tokenizer, wordpiece_tokenizer])
def test_the_text_of_growing_tokens_is_their_whole_decodes_at_every_step(make, bpe_run):
    tokenizer = make(bpe_run) if make is byte_level_tokenizer else make()
    stop = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    rng = random.Random(0)
    for case in range(40):
        first = rng.randrange(len(tokenizer))  # odd cases: a healed prompt's tail, the first token's text
        tokens = [first] if case % 2 and first != stop and "\ufffd" not in tokenizer.decode([first]) else []
        prompt = Prompt(torch.tensor([0]), tokenizer.decode(tokens))
        text = CompletionText(prompt, tokenizer, {stop})
        while len(tokens) < 60:  # one oracle call's tokens a step: a stop token among them now and then
            tokens += [rng.randrange(len(tokenizer)) if rng.random() > 0.05 else stop for _ in range(rng.randint(1, 5))]
            whole = prompt.completion(tokenizer, tokens, {stop})
            assert text(tokens) == whole, (tokens, whole)
            assert text(tokens) == whole  # asked again, with nothing new
        assert text(tokens[:-3]) == prompt.completion(tokenizer, tokens[:-3], {stop})  # a prefix: decoded whole


def test_a_character_split_across_tokens_waits_for_its_last_byte():
    tokenizer = sentencepiece_tokenizer()
    prompt = Prompt(torch.tensor([0]))
    text, snowman = CompletionText(prompt, tokenizer, set()), "\u2603".encode()  # three bytes
    ids = tokenizer.convert_tokens_to_ids(["▁def", *[f"<0x{b:02X}>" for b in snowman], "x"])
    assert text(ids[:2]) == "def\ufffd"
    assert text(ids[:3]) == "def\ufffd\ufffd"
    assert text(ids[:4]) == "def\u2603"
    assert text(ids) == "def\u2603x" == prompt.completion(tokenizer, ids, set())


@pytest.mark.parametrize("make, text", [(byte_level_tokenizer, "def f(x):\n    return x + 1\n" * 8),
                                        (sentencepiece_tokenizer, "def x(): return ab" * 12)])
def test_each_step_decodes_only_the_tokens_it_added_and_the_step_before(make, text, bpe_run, monkeypatch):
    tokenizer = make(bpe_run) if make is byte_level_tokenizer else make()
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) > 40
    decoded, decode = [], tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda ids, **kw: decoded.append(len(ids)) or decode(ids, **kw))
    completion = CompletionText(Prompt(torch.tensor([0])), tokenizer, set())
    for end in range(3, len(ids) + 3, 3):
        completion(ids[:end])
    assert completion.last == decode(ids) and max(decoded) <= 6  # a step's 3 tokens after the last step's 3
