"""Tokenizers: a pretrained one by name (GPT-2's, the paper's) or a byte-level BPE trained here.

Both are saved so that `AutoTokenizer.from_pretrained(RUN/tokenizer)` loads them (`decode.tokenizer`), and
both round-trip source text exactly (byte-level, no normalisation, no clean-up of spaces on decode).
"""
from collections.abc import Sequence

from decode.errors import InputError

END_OF_TEXT = "<|endoftext|>"
MIN_VOCAB_SIZE = 257  # the 256 byte symbols plus the end-of-text token


def check_vocab_size(vocab_size: int) -> None:
    if vocab_size < MIN_VOCAB_SIZE:
        raise InputError(
            f"vocabulary size {vocab_size} is too small: a byte-level BPE needs at least {MIN_VOCAB_SIZE} "
            f"(256 bytes + {END_OF_TEXT}); pass --vocab-size {MIN_VOCAB_SIZE} or more"
        )


def train_bpe(texts: Sequence[str], vocab_size: int, min_frequency: int = 2):
    """Train a GPT-2-style byte-level BPE on `texts`; returns a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    check_vocab_size(vocab_size)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    backend.train_from_iterator(texts, trainer, length=len(texts))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=END_OF_TEXT,
        eos_token=END_OF_TEXT,
        unk_token=END_OF_TEXT,
        clean_up_tokenization_spaces=False,
    )


def encode_documents(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens (the fast Rust batch path, no length warnings)."""
    encodings = tokenizer.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False)
    return [e.ids for e in encodings]
