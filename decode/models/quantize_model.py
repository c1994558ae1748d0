"""A GPT-2 checkpoint quantized to a block format (decode.models.quantized): the token embedding (also the output
layer) and every block's four matrices in Q8_0 or Q4_0, the position embeddings, layer norms and biases kept in
float32, as llama.cpp keeps them."""
import json
import shutil
from pathlib import Path

import torch

from decode.errors import InputError
from decode.models.engine import LINEAR, is_lean_compatible, read_config
from decode.models.pretrained import load_safetensors
from decode.models.quantized import CONFIG_KEY, QUANTIZED_FILE, Format, config_entry, format_of, quantized_tensors

WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "config.json")  # what a quantized copy does not copy


def is_quantized_matrix(name: str) -> bool:
    """Whether a GPT-2 weight (named without "transformer.") is one a quantized checkpoint holds in blocks."""
    return name == "wte.weight" or (name.startswith("h.") and name.endswith(".weight")
                                    and name.split(".", 2)[2].removesuffix(".weight") in LINEAR)


def oriented(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A matrix as llama.cpp stores it, (out, in): GPT-2's Conv1D layers hold theirs (in, out)."""
    return tensor if name == "wte.weight" else tensor.T


def check_quantizable(model_dir: Path, config: dict) -> None:
    """Refuse, in one line, a model this toolkit cannot quantize: one quantized already, or not a GPT-2."""
    fmt = format_of(config, model_dir)
    if fmt is not None:
        raise InputError(f"{model_dir} is quantized already ({fmt.name}); quantize the 16-bit model it was made from")
    if not is_lean_compatible(config):
        raise InputError(f"{model_dir} holds a {config.get('model_type')!r} model; decode.quantize quantizes GPT-2 "
                         f"checkpoints")
    if config["n_embd"] % 32:
        raise InputError(f"{model_dir}'s width n_embd={config['n_embd']} is not a multiple of 32, the blocks' length")


def quantize_checkpoint(model_dir: Path, out_dir: Path, fmt: Format) -> None:
    """Write `model_dir`'s GPT-2 quantized to `fmt` into the new directory `out_dir`: config.json (declaring the
    format), QUANTIZED_FILE, and every other file of the model's directory (tokenizer, generation config, the
    training token counts) as they are."""
    from safetensors.torch import save_file

    config = read_config(model_dir)
    check_quantizable(model_dir, config)
    weights = {name.removeprefix("transformer."): tensor for name, tensor in load_safetensors(model_dir).items()
               if name != "lm_head.weight"}  # tied to wte (is_lean_compatible)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(quantized_tensors(weights, is_quantized_matrix, fmt, oriented), out_dir / QUANTIZED_FILE,
              metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config | {CONFIG_KEY: config_entry(fmt)}, indent=2) + "\n")
    for path in Path(model_dir).iterdir():
        if path.is_file() and not any(path.match(pattern) for pattern in WEIGHT_FILES):
            shutil.copy2(path, out_dir / path.name)
