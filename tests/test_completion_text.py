"""A completion's text decoded as its tokens grow is the whole decode's at every step, on each kind of tokenizer
users' models ship: byte-level BPE (GPT-2, Llama 3, Qwen2), SentencePiece BPE with byte fallback (Llama 2, Mistral:
a text's first space stripped, characters split into byte tokens) and WordPiece with its spaces cleaned up."""
import random

import pytest
import torch
from decode_models import tiny_llama
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers import models as tokenizer_models
from transformers import PreTrainedTokenizerFast

from decode import SpeculativeDecoder
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
def test_the_text_of_growing_tokens_is_their_whole_decode_and_its_settled_part_never_changes(make, bpe_run):
    tokenizer = make(bpe_run) if make is byte_level_tokenizer else make()
    stop = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    rng = random.Random(0)
    for case in range(40):
        first = rng.randrange(len(tokenizer))  # odd cases: a healed prompt's tail, the first token's text
        tokens = [first] if case % 2 and first != stop and "\ufffd" not in tokenizer.decode([first]) else []
        prompt = Prompt(torch.tensor([0]), tokenizer.decode(tokens))
        text, streamed = CompletionText(prompt, tokenizer, {stop}), ""
        while len(tokens) < 60:  # one oracle call's tokens a step: a stop token among them now and then
            tokens += [rng.randrange(len(tokenizer)) if rng.random() > 0.05 else stop for _ in range(rng.randint(1, 5))]
            whole = prompt.completion(tokenizer, tokens, {stop})
            assert text(tokens) == whole, (tokens, whole)
            assert text(tokens) == whole  # asked again, with nothing new
            settled = whole[: text.settled(tokens)]
            assert settled.startswith(streamed), (tokens, settled, streamed)  # what was settled stays
            streamed = settled
        assert text(tokens[:-3]) == prompt.completion(tokenizer, tokens[:-3], {stop})  # a prefix: decoded whole
        assert text(tokens).startswith(streamed)


def test_a_character_split_across_tokens_waits_for_its_last_byte():
    tokenizer = sentencepiece_tokenizer()
    prompt = Prompt(torch.tensor([0]))
    text, snowman = CompletionText(prompt, tokenizer, set()), "\u2603".encode()  # three bytes
    ids = tokenizer.convert_tokens_to_ids(["▁def", *[f"<0x{b:02X}>" for b in snowman], "x"])
    assert text(ids[:2]) == "def\ufffd" and text.settled(ids[:2]) == 3
    assert text(ids[:3]) == "def\ufffd\ufffd" and text.settled(ids[:3]) == 3
    assert text(ids[:4]) == "def\u2603" and text.settled(ids[:4]) == 3  # a byte token after it could undo it
    assert text(ids) == "def\u2603x" == prompt.completion(tokenizer, ids, set()) and text.settled(ids) == 5


def test_a_run_of_byte_tokens_is_settled_once_a_token_of_text_ends_it():
    """SentencePiece decodes a run of byte tokens that is not valid UTF-8 to U+FFFD throughout: "a" then "\n" (both
    byte tokens) read "a\n" until a stray byte after them turns all three into U+FFFD."""
    tokenizer = sentencepiece_tokenizer()
    text = CompletionText(Prompt(torch.tensor([0])), tokenizer, set())
    ids = tokenizer.convert_tokens_to_ids(["▁def", "<0x61>", "<0x0A>", "<0xE2>", "x"])
    assert text(ids[:3]) == "defa\n" and text.settled(ids[:3]) == 3
    assert text(ids[:4]) == "def\ufffd\ufffd\ufffd" and text.settled(ids[:4]) == 3
    assert text(ids) == "def\ufffd\ufffd\ufffdx" and text.settled(ids) == 7


def code_ids(tokenizer) -> list[int]:
    return tokenizer("def f(x):\n    return x + 1\n" * 8, add_special_tokens=False).input_ids


def piece_ids(tokenizer) -> list[int]:  # SentencePiece's pieces, a newline (a byte token) now and then
    return tokenizer.convert_tokens_to_ids(["▁def", "x", "(", "):", "<0x0A>", "▁return", "▁ab"] * 8)


@pytest.mark.parametrize("make, ids_of", [(byte_level_tokenizer, code_ids), (sentencepiece_tokenizer, piece_ids)])
def test_each_step_decodes_only_the_tokens_it_added_and_the_step_before(make, ids_of, bpe_run):
    tokenizer = make(bpe_run) if make is byte_level_tokenizer else make()
    ids = ids_of(tokenizer)
    assert len(ids) > 40
    completion = CompletionText(Prompt(torch.tensor([0])), tokenizer, set())
    decoded, decode = [], completion.decode
    completion.decode = lambda ids: decoded.append(len(ids)) or decode(ids)
    for end in range(3, len(ids) + 3, 3):
        completion(ids[:end])
        completion.settled(ids[:end])
    # a step's 3 tokens after the last step's 3, or after the 6 before them where those ended in a byte token
    assert completion(ids) == tokenizer.decode(ids) and max(decoded) <= 9


def test_a_sentencepiece_models_streamed_pieces_join_to_its_generated_text_when_sampling(tmp_path):
    """A random model over SentencePiece's byte tokens emits runs that are not valid UTF-8 and then end: the pieces
    sent before such a run ended must not hold the text its bytes had while it was still valid."""
    tokenizer = sentencepiece_tokenizer()
    oracle = tiny_llama(tmp_path / "oracle", vocab_size=len(tokenizer), seed=0, tokenizer=tokenizer)
    draft = tiny_llama(tmp_path / "draft", vocab_size=len(tokenizer), seed=1, noise_from=oracle, noise=0.005,
                       tokenizer=tokenizer)
    for method in ("baseline", "speculative"):
        decoder = SpeculativeDecoder.from_pretrained(oracle, draft if method != "baseline" else None, method=method,
                                                     dtype="float32")
        for seed in range(12):
            settings = {"max_new_tokens": 40, "do_sample": True, "temperature": 1.0, "seed": seed}
            text = decoder.generate("def x", **settings).text
            assert "".join(decoder.stream("def x", **settings)) == text, (method, seed)
