"""A GPT-2 or Llama-family checkpoint quantized to a block format (decode.models.quantized): the token embedding, the
output layer and every block's matrices in Q8_0 or Q4_0, the position embeddings, norms and biases kept in float32, as
llama.cpp keeps them."""
import json
import shutil
from pathlib import Path

import torch

from decode.errors import InputError
from decode.models.engine import LINEAR, is_lean_compatible
from decode.models.llama import LlamaShape, unsupported
from decode.models.model_config import read_config
from decode.models.pretrained import load_safetensors
from decode.models.quantized import CONFIG_KEY, QUANTIZED_FILE, Format, config_entry, format_of, quantized_tensors

WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "config.json")  # what a quantized copy does not copy


def is_quantized_matrix(name: str) -> bool:
    """Whether a weight is one a quantized checkpoint holds in blocks: a GPT-2's (named without "transformer.") wte and
    blocks' four matrices, a Llama-family model's embeddings, output layer and blocks' projections."""
    gpt2 = name == "wte.weight" or (name.startswith("h.") and name.endswith(".weight")
                                    and name.split(".", 2)[2].removesuffix(".weight") in LINEAR)
    llama = name in ("model.embed_tokens.weight", "lm_head.weight") or (
        name.startswith("model.layers.") and name.endswith("_proj.weight"))
    return gpt2 or llama


def oriented(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A matrix as llama.cpp stores it, (out, in): GPT-2's Conv1D layers hold theirs (in, out), the others so."""
    return tensor.T if name.startswith("h.") else tensor


def check_quantizable(model_dir: Path, config: dict) -> None:
    """Refuse, in one line, a model this toolkit cannot quantize: one quantized already, one the lean engine does not
    run, or one with a product's input not a multiple of the blocks' length."""
    fmt = format_of(config, model_dir)
    if fmt is not None:
        raise InputError(f"{model_dir} is quantized already ({fmt.name}); quantize the 16-bit model it was made from")
    llama = config.get("model_type") != "gpt2"
    if llama and unsupported(config) or not llama and not is_lean_compatible(config):
        raise InputError(f"{model_dir} holds a {config.get('model_type')!r} model the lean engine does not run; "
                         f"decode.quantize quantizes the GPT-2 and Llama-family models it runs")
    if llama:
        shape = LlamaShape.from_config(config)
        widths = {"hidden_size": shape.n_embd, "intermediate_size": shape.intermediate,
                  "heads x head_dim": shape.n_head * shape.head_dim}
    else:
        widths = {"n_embd": config["n_embd"]}
    for name, width in widths.items():
        if width % 32:
            raise InputError(f"{model_dir}'s {name}={width} is not a multiple of 32, the blocks' length")


def checkpoint_in_blocks(model_dir: Path, config: dict, fmt: Format) -> dict[str, torch.Tensor]:
    """The tensors of `model_dir`'s 16-bit checkpoint quantized to `fmt`, as QUANTIZED_FILE holds them: a quantized
    checkpoint's, or a model quantized as it loads (decode.models.loading.load_model's `quantization`)."""
    check_quantizable(model_dir, config)
    gpt2 = config.get("model_type") == "gpt2"  # (its lm_head is tied to wte: is_lean_compatible)
    weights = {name.removeprefix("transformer.") if gpt2 else name: tensor
               for name, tensor in load_safetensors(model_dir).items() if not (gpt2 and name == "lm_head.weight")}
    return quantized_tensors(weights, is_quantized_matrix, fmt, oriented)


def quantize_checkpoint(model_dir: Path, out_dir: Path, fmt: Format) -> None:
    """Write `model_dir`'s model quantized to `fmt` into the new directory `out_dir`: config.json (declaring the
    format), QUANTIZED_FILE, and every other file of the model's directory (tokenizer, generation config, the
    training token counts) as they are."""
    from safetensors.torch import save_file

    config = read_config(model_dir)
    tensors = checkpoint_in_blocks(model_dir, config, fmt)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / QUANTIZED_FILE, metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config | {CONFIG_KEY: config_entry(fmt)}, indent=2) + "\n")
    for path in Path(model_dir).iterdir():
        if path.is_file() and not any(path.match(pattern) for pattern in WEIGHT_FILES):
            shutil.copy2(path, out_dir / path.name)
