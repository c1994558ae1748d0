"""Loading the models a decoder uses: the oracle and the draft (the lean engine or transformers'), the draft's
shortlist, the Katz trigram, and models given by hub name or already loaded."""
import json
import logging
from pathlib import Path

import numpy as np

from decode.errors import InputError, check_path
from decode.models.cached_lm import CachedLM
from decode.models.engine import GPT2Engine
from decode.models.hf_backend import HFEngine
from decode.models.lean_engine import LeanEngine
from decode.models.llama import LlamaEngine
from decode.models.model_config import read_config
from decode.models.native_rows import native_forward
from decode.models.pretrained import model_dir
from decode.models.quantized import Format, dtype_and_format, format_of
from decode.models.successors import SuccessorTable
from decode.shortlist import Shortlist
from decode.tokenizer import load_tokenizer

TOKEN_COUNTS = "token_counts.npy"  # beside a trained model: its training split's count of each token id
log = logging.getLogger("decode.models")  # notes a user sees on stderr without any logging set up (warnings)


def pretrained_dir(model, tokenizer, keep: list, name: str) -> Path:
    """A directory that holds `model`: a local directory as it is, a hub name downloaded (huggingface_hub's cache),
    or a loaded transformers model saved with `tokenizer` into a temporary directory added to `keep`."""
    import tempfile

    if hasattr(model, "save_pretrained"):
        if tokenizer is None:
            raise InputError(f"a loaded {name} model needs its tokenizer: pass tokenizer=...")
        directory = tempfile.TemporaryDirectory(prefix=f"staged-speculative-{name}-")
        keep.append(directory)
        model.save_pretrained(directory.name)
        tokenizer.save_pretrained(directory.name)
        return Path(directory.name)
    if not isinstance(model, (str, Path)):
        raise InputError(f"{name} must be a directory, a hub name or a loaded transformers model (got {type(model).__name__})")
    return model_dir(model, name)


def load_trigram(options, vocab_size: int, eos_id: int):

    if options.ngram is None:
        raise InputError(f"--method {options.method} needs the Katz trigram; pass --ngram DIR (python ngram/build_katz.py)")
    check_path(options.ngram, True, "trigram directory", "pass --ngram DIR (python ngram/build_katz.py writes one)")
    meta_path = Path(options.ngram) / "meta.json"
    if not meta_path.is_file():  # written last: without it the directory is not a finished trigram
        raise InputError(f"{options.ngram} has no meta.json, so python ngram/build_katz.py did not finish writing it (or it "
                         f"is not a trigram directory); build one with `python ngram/build_katz.py --out NEW_DIR`")
    try:
        meta = json.loads(meta_path.read_text())
        built_for = (int(meta["vocab_size"]), int(meta["eos_id"]))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
        raise InputError(f"{meta_path} is damaged ({type(err).__name__}: {err}); rebuild the trigram with "
                         f"`python ngram/build_katz.py --out {options.ngram} --overwrite`") from None
    table = SuccessorTable.load(Path(options.ngram) / "successors.npz")
    if built_for != (table.vocab_size, table.eos_id):
        raise InputError(f"{meta_path} says a vocabulary of {built_for[0]} tokens (end-of-text {built_for[1]}) but its "
                         f"successors.npz holds {table.vocab_size} ({table.eos_id}); rebuild the trigram with "
                         f"`python ngram/build_katz.py --out {options.ngram} --overwrite`")
    if table.vocab_size != vocab_size or table.eos_id != eos_id:
        raise InputError(f"the trigram in {options.ngram} was built for a vocabulary of {table.vocab_size} tokens "
                         f"(end-of-text {table.eos_id}), the oracle has {vocab_size} (end-of-text {eos_id}); rebuild it from this run")
    return table


def load_model(directory: Path, backend: str, dtype: str, device: str, cuda_graphs: bool = False,
               compile_layers: bool = False, shortlist: Shortlist | None = None, calibrate: bool = False,
               quantization: Format | None = None) -> CachedLM:
    """A model for decoding; the lean engine stores each matrix in its calibrated layout and runs a forward of a few
    rows in C++ up to where that was calibrated faster, its products on AMX's tiles where those were
    (decode.models.native_rows); `calibrate` measures (and keeps) what was not yet. With a `quantization`, a 16-bit
    model's matrices are quantized to its blocks as it loads, as decode.quantize would write them; with
    `compile_layers`, torch's forward computes the lean engine's layers through torch.compile."""
    config = read_config(directory)
    fmt = format_of(config, directory) or quantization
    if fmt is not None and backend == "hf":
        what = f"is a {fmt.name} checkpoint, which" if quantization is None else f"quantized to {fmt.name} as it loads"
        raise InputError(f"{directory} {what} runs on the lean engine, not transformers': pass --backend auto (or lean)")
    tokens = token_rows(directory, config)
    engine_class, why_not = lean_engine_class(config)
    if backend == "lean" and engine_class is None:
        raise InputError(f"{directory} cannot run on the lean engine: {why_not}; use the transformers backend (--backend hf)")
    if engine_class is not None and backend in ("lean", "auto"):
        engine = engine_class.load(directory, dtype, device, cuda_graphs=cuda_graphs, shortlist=shortlist,
                                   native_blocks=True, calibrate=calibrate, tokens=tokens, quantization=quantization,
                                   compile_layers=compile_layers)
        forward = native_forward(directory, engine, dtype, calibrate=calibrate)
        engine.runtime.use(forward.rows, forward.tiles)
        return engine
    if backend == "auto":
        log.warning("note: %s runs on the transformers backend, several times slower a step than the lean engine: %s",
                    directory, why_not)
    return HFEngine.load(directory, dtype, device, shortlist=shortlist, tokens=tokens)


def lean_engine_class(config: dict) -> tuple[type[LeanEngine] | None, str | None]:
    """The lean engine that runs a model of this config (GPT-2, or the Llama family), or None and why not."""
    engine: type[LeanEngine] = GPT2Engine if config.get("model_type") == "gpt2" else LlamaEngine
    why = engine.why_not(config)
    return (None, why) if why else (engine, None)


def lean_engine_of(directory) -> type[LeanEngine]:
    """The lean engine class of a model directory the caller knows has one."""
    engine = lean_engine_class(read_config(directory))[0]
    assert engine is not None
    return engine


def token_rows(directory: Path, config: dict) -> int | None:
    """How many of a model's output rows stand for tokens, where its config pads the output past its tokenizer's
    (Qwen2.5's 151,936 rows over 151,665 tokens): decoding leaves the padded rows out of every model, so they are never
    drafted or sampled, and a draft and an oracle padded differently decode together. None: every row is a token's (or
    the directory holds no tokenizer to tell)."""
    try:
        tokens = len(load_tokenizer(directory))
    except InputError:
        return None
    return tokens if tokens < config.get("vocab_size", tokens) else None


def draft_shortlist(draft_dir: Path, size: int, vocab_size: int) -> Shortlist | None:
    """The draft's `size` most frequent training tokens (None: the whole vocabulary, for 0 or at least its size)."""
    if size == 0 or size >= vocab_size:
        return None
    path = Path(draft_dir) / TOKEN_COUNTS
    if not path.is_file():
        raise InputError(f"--draft-vocab needs {path}, the draft's training token counts (training writes them beside "
                         f"the model; older models lack them): re-train the draft, or numpy.save there "
                         f"data.shards.token_counts(RUN/data)")
    try:
        counts = np.load(path)
    except (OSError, ValueError) as err:
        raise InputError(f"{path} is not a numpy array of token counts ({err}); re-train the draft") from None
    if counts.shape != (vocab_size,):
        raise InputError(f"{path} counts {counts.size} tokens, the draft has {vocab_size}; re-train the draft")
    return Shortlist.most_frequent(counts, size)


def draft_precision(options) -> tuple[str, Format | None]:
    """The dtype the options' draft computes in, and the block format its matrices are quantized to as it loads (None:
    as stored): --draft-dtype names either (a format's draft computes in the oracle's dtype), else the oracle's dtype."""
    return dtype_and_format(options.draft_dtype or options.dtype, options.dtype)


def load_draft(options, vocab_size: int) -> CachedLM:
    """The draft model as the options load it, its output layer over `options.draft_vocab` tokens when set."""
    dtype, quantization = draft_precision(options)
    return load_model(options.draft, options.backend, dtype, options.device, options.cuda_graphs, options.compile_layers,
                      draft_shortlist(options.draft, options.draft_vocab, vocab_size), quantization=quantization)


def check_same_vocabulary(oracle_dir: Path, other_dir: Path, other: str) -> None:
    a, b = load_tokenizer(oracle_dir), load_tokenizer(other_dir)
    if a.get_vocab() != b.get_vocab():
        raise InputError(f"the oracle ({oracle_dir}) and the {other} ({other_dir}) use different tokenizers; "
                         f"train the {other} with the oracle's tokenizer")
