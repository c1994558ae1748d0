"""A GPT-2 or Llama-family checkpoint (its save_pretrained directory, or a quantized GPT-2) as a GGUF file, the format
llama.cpp, llama-server and Ollama read: the architecture's hyperparameters, the tokenizer (byte-level BPE: its
tokens, their types, its merges and how it splits text first) and the weights under llama.cpp's names, the matrices as (out, in), a quantized
model's in its Q8_0 or Q4_0 blocks. llama.cpp's "llama" architecture (Llama, Mistral) rotates each head's pairs of
adjacent elements where transformers rotates its two halves, so its query and key rows are reordered to match, as
llama.cpp's own converter does; a rope scaling other than the default goes as its per-frequency factors."""
import json
from pathlib import Path

import numpy as np
import torch

from decode.errors import InputError
from decode.models.engine import is_lean_compatible
from decode.models.llama import LlamaShape, rope_type, rotary_inverse_frequencies, unsupported
from decode.models.model_config import read_config
from decode.models.pretrained import load_safetensors
from decode.models.quantized import FORMATS, Format, QuantizedMatrix, checkpoint_blocks, format_of, split_checkpoint
from decode.tokenizer import load_tokenizer, start_ids

GGUF_DTYPES = ("float32", "bfloat16")  # the matrices' dtype in the file; norms and biases stay float32
# Hugging Face's GPT-2 names (after "transformer.") -> llama.cpp's; the Conv1D matrices are stored (in, out)
BLOCK_TENSORS = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
                 "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


# The ways of splitting text before a byte-level BPE that llama.cpp implements, by the name a GGUF gives them
# (tokenizer.ggml.pre), each as a tokenizer.json's pre-tokenizer spells it: GPT-2's regex (GPT-2's own tokenizer, and
# the one data.prepare trains), Llama 3's and Qwen2's regexes ahead of the bytes, and SmolLM's digits one by one ahead
# of GPT-2's regex. A step lists the fields that must hold, a missing field read as its default.
GPT2_REGEX_BYTES = {"type": "ByteLevel", "use_regex": True, "add_prefix_space": False}
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")


def split_then_bytes(regex: str) -> list[dict]:
    return [{"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "use_regex": False, "add_prefix_space": False}]


PRE_TOKENIZERS = {"gpt-2": [GPT2_REGEX_BYTES], "llama-bpe": split_then_bytes(LLAMA3_REGEX),
                  "qwen2": split_then_bytes(QWEN2_REGEX),
                  "smollm": [{"type": "Digits", "individual_digits": True}, GPT2_REGEX_BYTES]}
STEP_DEFAULTS = {"use_regex": True, "add_prefix_space": False, "invert": False, "individual_digits": False}


def pre_tokenizer_name(pre_tokenizer: dict | None) -> str | None:
    """The GGUF name of a tokenizer.json's pre-tokenizer (PRE_TOKENIZERS), or None where llama.cpp has none for it."""
    steps = (pre_tokenizer or {}).get("pretokenizers") if (pre_tokenizer or {}).get("type") == "Sequence" else [pre_tokenizer or {}]
    for name, wanted in PRE_TOKENIZERS.items():
        if len(steps or []) == len(wanted) and all(
                all(step.get(key, STEP_DEFAULTS.get(key)) == value for key, value in want.items())
                for step, want in zip(steps or [], wanted)):
            return name
    return None


def bpe_of(tokenizer, model_dir: Path) -> tuple[str, list[str]]:
    """The tokenizer's pre-tokenizer, by its GGUF name, and its BPE merges as "left right" lines, from the tokenizer's
    own serialization: a byte-level BPE whose splitting llama.cpp implements (PRE_TOKENIZERS)."""
    serialized = json.loads(tokenizer.backend_tokenizer.to_str())
    model, pre = serialized["model"], pre_tokenizer_name(serialized.get("pre_tokenizer"))
    if model.get("type") != "BPE" or pre is None:
        split = serialized.get("pre_tokenizer") or {}
        kinds = [step.get("type") for step in split.get("pretokenizers", [split])]
        raise InputError(f"{model_dir}'s tokenizer is not a byte-level BPE that splits text as GPT-2, Llama 3, Qwen2 or "
                         f"SmolLM do (a {model.get('type')} model, pre-tokenizer {' then '.join(map(str, kinds))}); "
                         f"convert this model with llama.cpp's convert_hf_to_gguf.py")
    return pre, [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]


def vocabulary(tokenizer, vocab_size: int) -> tuple[list[str], list]:
    """Every token id's string and GGUF token type, padded to the model's `vocab_size` with unused entries."""
    import gguf

    by_id = {i: token for token, i in tokenizer.get_vocab().items()}
    special = set(tokenizer.all_special_ids)
    tokens, types = [], []
    for i in range(vocab_size):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    return tokens, types


def gguf_tensors(weights: dict, n_layer: int) -> dict:
    """The checkpoint's tensors under llama.cpp's GPT-2 names; the output layer is the token embedding (tied). A
    quantized checkpoint's matrices (QuantizedMatrix) are (out, in) already."""
    w = {name.removeprefix("transformer."): tensor for name, tensor in weights.items()}
    out = {"token_embd.weight": w["wte.weight"], "position_embd.weight": w["wpe.weight"],
           "output_norm.weight": w["ln_f.weight"], "output_norm.bias": w["ln_f.bias"], "output.weight": w["wte.weight"]}
    for i in range(n_layer):
        for ours, theirs in BLOCK_TENSORS.items():
            for part in ("weight", "bias"):
                tensor = w[f"h.{i}.{ours}.{part}"]
                conv1d = ours in CONV1D and part == "weight" and not isinstance(tensor, QuantizedMatrix)
                out[f"blk.{i}.{theirs}.{part}"] = tensor.T if conv1d else tensor
    return out


# The Llama family's names (after "model.") -> llama.cpp's
LLAMA_TENSORS = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def pairs_adjacent(rows, heads: int):
    """A query or key matrix's (or bias's, or blocks') rows reordered per head from transformers' halves to llama.cpp's
    pairs."""
    order = torch.arange(rows.shape[0]).reshape(heads, 2, -1).swapaxes(1, 2).flatten()
    return rows.rows(order) if isinstance(rows, QuantizedMatrix) else rows[order]


def llama_tensors(weights: dict, shape: LlamaShape, architecture: str) -> dict:
    """A Llama-family checkpoint's tensors under llama.cpp's names; the output layer is the token embedding where
    tied."""
    w = {name.removeprefix("model."): tensor for name, tensor in weights.items()}
    out = {"token_embd.weight": w["embed_tokens.weight"], "output_norm.weight": w["norm.weight"],
           "output.weight": w.get("lm_head.weight", w["embed_tokens.weight"]) if not shape.tied else w["embed_tokens.weight"]}
    heads = {"self_attn.q_proj": shape.n_head, "self_attn.k_proj": shape.n_kv_head}
    for i in range(shape.n_layer):
        for ours, theirs in LLAMA_TENSORS.items():
            for part in ("weight", "bias"):
                tensor = w.get(f"layers.{i}.{ours}.{part}")
                if tensor is None:
                    continue
                if architecture == "llama" and ours in heads:
                    tensor = pairs_adjacent(tensor, heads[ours])
                out[f"blk.{i}.{theirs}.{part}"] = tensor
    return out


def add_llama_hyperparameters(writer, config: dict, shape: LlamaShape, architecture: str) -> dict:
    """A Llama-family model's hyperparameters; returns the tensors they add (llama.cpp's per-frequency rope factors,
    for a rope scaling other than the default)."""
    writer.add_context_length(config.get("max_position_embeddings", shape.n_positions))
    writer.add_embedding_length(shape.n_embd)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_block_count(shape.n_layer)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_kv_head)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_layer_norm_rms_eps(shape.epsilon)
    scaled, default, theta = rotary_inverse_frequencies(config)
    writer.add_rope_freq_base(theta)
    if rope_type(config) == "default":
        return {}
    if architecture != "llama" or rope_type(config) == "yarn":
        raise InputError(f"the GGUF export writes a {rope_type(config)!r} rope scaling for llama and mistral models only, "
                         f"and not yarn's; convert this model with llama.cpp's convert_hf_to_gguf.py")
    return {"rope_freqs.weight": (default / scaled).to(torch.float32)}


def checkpoint_of(model_dir: Path, config: dict, quantization: Format | None) -> tuple[dict, str | None]:
    """The model's tensors by checkpoint name (a quantized model's matrices as QuantizedMatrix, a 16-bit one's
    quantized to `quantization` where given) and their block format's name (None: not quantized)."""
    blocks = checkpoint_blocks(model_dir, config, None if format_of(config, model_dir) else quantization)
    if blocks is None:
        return load_safetensors(model_dir), None
    fmt, tensors = blocks
    dense, quantized = split_checkpoint(tensors(), fmt, model_dir)
    return dense | quantized, fmt.name


def write_gguf(model_dir: Path, path: Path, dtype: str = "float32") -> None:
    """The GPT-2 or Llama-family model in `model_dir` as a GGUF file at `path`, its matrices in `dtype` (a block
    format: quantized as decode.quantize quantizes them); a quantized model's in its own blocks, the very bytes the
    engine computes with (`dtype` then applies to nothing)."""
    import gguf

    if dtype not in (*GGUF_DTYPES, *FORMATS):
        raise InputError(f"a GGUF's dtype is one of {', '.join((*GGUF_DTYPES, *FORMATS))} (got {dtype!r})")
    config = read_config(model_dir)
    llama = config.get("model_type") != "gpt2"
    if llama and unsupported(config) or not llama and not is_lean_compatible(config):
        raise InputError(f"{model_dir} holds a {config.get('model_type')!r} model the lean engine does not run "
                         f"({unsupported(config) if llama else 'a GPT-2 variant'}); the GGUF export writes the models it runs")
    weights, quantized = checkpoint_of(model_dir, config, FORMATS.get(dtype))
    tokenizer = load_tokenizer(model_dir)
    pre_tokenizer, merges = bpe_of(tokenizer, model_dir)
    architecture = "qwen2" if config["model_type"] == "qwen2" else ("llama" if llama else "gpt2")
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_name(Path(model_dir).resolve().name)
    if llama:
        shape = LlamaShape.from_config(config)
        tensors = llama_tensors(weights, shape, architecture)
        tensors |= add_llama_hyperparameters(writer, config, shape, architecture)
    else:
        n_embd = config["n_embd"]
        writer.add_context_length(config["n_positions"])
        writer.add_embedding_length(n_embd)
        writer.add_feed_forward_length(config.get("n_inner") or 4 * n_embd)
        writer.add_block_count(config["n_layer"])
        writer.add_head_count(config["n_head"])
        writer.add_layer_norm_eps(config["layer_norm_epsilon"])
        tensors = gguf_tensors(weights, config["n_layer"])
    file_types = {"float32": gguf.LlamaFileType.ALL_F32, "bfloat16": gguf.LlamaFileType.MOSTLY_BF16,
                  "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}
    writer.add_file_type(file_types[quantized or dtype])
    tokens, types = vocabulary(tokenizer, config["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    start = start_ids(tokenizer)  # the token a text starts with: the tokenizer's own (Llama 3's), else end-of-text
    writer.add_bos_token_id(start[0] if start else tokenizer.eos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_add_bos_token(bool(start))
    for name, tensor in tensors.items():
        if isinstance(tensor, QuantizedMatrix):  # llama.cpp's blocks as they are
            writer.add_tensor(name, tensor.block_bytes().numpy(), raw_dtype=gguf.GGMLQuantizationType[tensor.format.name.upper()])
            continue
        values = np.ascontiguousarray(tensor.float().numpy())
        if dtype == "bfloat16" and values.ndim == 2:  # numpy has no bfloat16: gguf packs its bits
            qtype = gguf.GGMLQuantizationType.BF16
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
