"""A GPT-2 checkpoint (its save_pretrained directory, or a quantized one) as a GGUF file, the format llama.cpp,
llama-server and Ollama read: the architecture's hyperparameters, the tokenizer (byte-level BPE: its tokens, their
types and its merges) and the weights under llama.cpp's names, the matrices as (out, in), a quantized model's in its
Q8_0 or Q4_0 blocks."""
import json
from pathlib import Path

import numpy as np

from decode.errors import InputError
from decode.models.engine import is_lean_compatible, read_config
from decode.models.pretrained import load_safetensors
from decode.models.quantized import QuantizedMatrix, format_of, split_checkpoint
from decode.tokenizer import load_tokenizer

GGUF_DTYPES = ("float32", "bfloat16")  # the matrices' dtype in the file; norms and biases stay float32
# Hugging Face's GPT-2 names (after "transformer.") -> llama.cpp's; the Conv1D matrices are stored (in, out)
BLOCK_TENSORS = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
                 "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def merges_of(tokenizer, model_dir: Path) -> list[str]:
    """The BPE merges as "left right" lines, from the tokenizer's own serialization."""
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    if model.get("type") != "BPE":
        raise InputError(f"{model_dir}'s tokenizer is a {model.get('type')} model; the GGUF export writes byte-level BPE "
                         f"tokenizers (GPT-2's, and the one data.prepare trains)")
    return [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]


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


def checkpoint_of(model_dir: Path, config: dict) -> tuple[dict, str | None]:
    """The model's tensors by checkpoint name (a quantized model's matrices as QuantizedMatrix) and its block format's
    name (None: not quantized)."""
    fmt = format_of(config, model_dir)
    if fmt is None:
        return load_safetensors(model_dir), None
    dense, quantized = split_checkpoint(load_safetensors(model_dir), fmt, model_dir)
    return dense | quantized, fmt.name


def write_gguf(model_dir: Path, path: Path, dtype: str = "float32") -> None:
    """The GPT-2 in `model_dir` as a GGUF file at `path`, its matrices in `dtype`; a quantized model's in its own
    blocks, the very bytes the engine computes with (`dtype` then applies to nothing)."""
    import gguf

    if dtype not in GGUF_DTYPES:
        raise InputError(f"a GGUF's dtype is one of {', '.join(GGUF_DTYPES)} (got {dtype!r})")
    config = read_config(model_dir)
    if not is_lean_compatible(config):
        raise InputError(f"{model_dir} holds a {config.get('model_type')!r} model; the GGUF export writes GPT-2 checkpoints")
    n_embd, n_layer = config["n_embd"], config["n_layer"]
    weights, quantized = checkpoint_of(model_dir, config)
    tokenizer = load_tokenizer(model_dir)
    merges = merges_of(tokenizer, model_dir)
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_name(Path(model_dir).resolve().name)
    writer.add_context_length(config["n_positions"])
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(config.get("n_inner") or 4 * n_embd)
    writer.add_block_count(n_layer)
    writer.add_head_count(config["n_head"])
    writer.add_layer_norm_eps(config["layer_norm_epsilon"])
    file_types = {"float32": gguf.LlamaFileType.ALL_F32, "bfloat16": gguf.LlamaFileType.MOSTLY_BF16,
                  "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}
    writer.add_file_type(file_types[quantized or dtype])
    tokens, types = vocabulary(tokenizer, config["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")  # GPT-2's pre-tokenizing regex, as a byte-level BPE trained here uses
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.eos_token_id)  # GPT-2 has one special token: it starts and ends a text
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_add_bos_token(False)
    for name, tensor in gguf_tensors(weights, n_layer).items():
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
