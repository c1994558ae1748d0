"""Weight-only quantized matrices in llama.cpp's block formats, Q8_0 and Q4_0, and the checkpoints that hold them.

A matrix is quantized as llama.cpp stores it, (out, in), in blocks of 32 consecutive weights along `in`: each block
one float16 scale d and 32 integers q, the weight being q d. Q8_0: q = round(w / d) in -127..127, d = max |w| / 127.
Q4_0: q in 0..15 stored as q - 8 (so -8..7), d = w_max / -8 where w_max is the block's weight of largest magnitude;
a block's byte j holds the values of weights j (low nibble) and j + 16 (high nibble). Quantizing here gives the bits
llama.cpp's own reference quantizer (llama-quantize, without an importance matrix) gives from the same float32
values, so a GGUF file written from these blocks is the model this engine computes with.

A quantized checkpoint is a model directory: config.json with a "staged_quantization" entry naming the format, the
tokenizer, and QUANTIZED_FILE, whose tensors are the matrices' quants ("NAME.quants": int8 (out, in) for Q8_0, uint8
(out, in / 2) for Q4_0) and scales ("NAME.scales": float16 (out, in / 32)), beside the unquantized tensors (position
embeddings, layer norms, biases) under their own names. transformers finds no weights file it knows there, so it
refuses such a directory rather than loading it as a 16-bit model with missing weights.
"""
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from decode.errors import InputError

QUANTIZED_FILE = "quantized.safetensors"
CONFIG_KEY = "staged_quantization"
BLOCK = 32  # weights a block (llama.cpp's QK8_0 and QK4_0)


@dataclass(frozen=True)
class Format:
    """One block format: its name (as llama.cpp's tools spell it), its code in native/forward.cpp, its quants' dtype
    and how many weights a byte of them holds."""

    name: str
    code: int
    quant_dtype: torch.dtype
    per_byte: int

    @property
    def block_bytes(self) -> int:
        """Bytes a block of 32 weights takes, its scale included (llama.cpp's block_q8_0, block_q4_0)."""
        return 2 + BLOCK // self.per_byte

    @property
    def bits(self) -> float:
        return 8 * self.block_bytes / BLOCK


Q8_0 = Format("q8_0", 1, torch.int8, 1)
Q4_0 = Format("q4_0", 2, torch.uint8, 2)
FORMATS = {f.name: f for f in (Q8_0, Q4_0)}


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf: to nearest, halves away from zero (torch.round rounds them to even). x - trunc(x) is exact."""
    whole = torch.trunc(x)
    return whole + torch.where((x - whole).abs() >= 0.5, torch.sign(x), torch.zeros_like(x))


def reciprocal_or_zero(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / torch.where(d == 0, torch.ones_like(d), d))


@dataclass
class QuantizedMatrix:
    """An (out, in) matrix in a block format: `quants` as FORMATS says, `scales` float16 (out, in / 32)."""

    format: Format
    quants: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def quantize(cls, matrix: torch.Tensor, fmt: Format) -> "QuantizedMatrix":
        """An (out, in) matrix (`in` a multiple of 32) quantized as llama.cpp's reference quantizer does it, from its
        float32 values."""
        out, in_features = matrix.shape
        if in_features % BLOCK:
            raise InputError(f"a {fmt.name} matrix needs a multiple of {BLOCK} input features (got {in_features})")
        blocks = matrix.detach().to(torch.float32).reshape(out, in_features // BLOCK, BLOCK)
        if fmt is Q8_0:
            d = blocks.abs().amax(-1, keepdim=True) / 127
            quants = round_half_away(blocks * reciprocal_or_zero(d)).to(torch.int8).reshape(out, in_features)
        else:  # the first weight of largest magnitude, with its sign, is -8 d
            d = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True)) / -8
            values = torch.trunc(blocks * reciprocal_or_zero(d) + 8.5).clamp(max=15).to(torch.uint8)
            quants = (values[..., : BLOCK // 2] | (values[..., BLOCK // 2 :] << 4)).reshape(out, in_features // 2)
        return cls(fmt, quants.contiguous(), d.reshape(out, -1).to(torch.float16).contiguous())

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * BLOCK

    @property
    def code(self) -> int:
        return self.format.code

    def values(self) -> torch.Tensor:
        """The integers q (out, in) as float32: each weight is q times its block's scale."""
        out, in_features = self.shape
        if self.format is Q8_0:
            return self.quants.to(torch.float32)
        low, high = (self.quants & 15, self.quants >> 4)
        blocks = torch.cat([low.reshape(out, -1, BLOCK // 2), high.reshape(out, -1, BLOCK // 2)], dim=-1)
        return blocks.reshape(out, in_features).to(torch.float32) - 8

    def dequantize(self) -> torch.Tensor:
        """The float32 (out, in) matrix the blocks stand for (each weight q d is exact in float32)."""
        out, in_features = self.shape
        values = self.values().reshape(out, -1, BLOCK)
        return (values * self.scales.to(torch.float32)[..., None]).reshape(out, in_features)

    @classmethod
    def stacked(cls, matrices: list["QuantizedMatrix"]) -> "QuantizedMatrix":
        """The matrix of these matrices' output rows, one matrix's after another's (a layer's fused projections)."""
        return cls(matrices[0].format, torch.cat([m.quants for m in matrices]), torch.cat([m.scales for m in matrices]))

    def rows(self, index: torch.Tensor | slice) -> "QuantizedMatrix":
        """The matrix of these output rows (a shortlist's tokens of an output layer, or its unpadded rows)."""
        return QuantizedMatrix(self.format, self.quants[index], self.scales[index])

    def block_bytes(self) -> torch.Tensor:
        """The uint8 (out, in / 32 x block bytes) of llama.cpp's blocks: each block's scale then its quants, as a GGUF
        file holds them."""
        out = self.shape[0]
        scales = self.scales.contiguous().view(torch.uint8).reshape(out, -1, 2)
        quants = self.quants.contiguous().view(torch.uint8).reshape(out, scales.shape[1], -1)
        return torch.cat([scales, quants], dim=-1).reshape(out, -1)

    def check(self, name: str) -> None:
        """Refuse, naming the tensor, quants and scales whose dtypes or shapes do not agree with the format."""
        out, groups = self.scales.shape if self.scales.dim() == 2 else (-1, -1)
        expected = (out, groups * BLOCK // self.format.per_byte)
        if (self.scales.dtype != torch.float16 or self.quants.dtype != self.format.quant_dtype or out < 0
                or tuple(self.quants.shape) != expected):
            raise InputError(f"{name}: {self.format.name} needs float16 scales (out, in/{BLOCK}) and "
                             f"{self.format.quant_dtype} quants {expected}; the file holds scales "
                             f"{self.scales.dtype} {tuple(self.scales.shape)} and quants {self.quants.dtype} "
                             f"{tuple(self.quants.shape)}: quantize the model again (python -m decode.quantize)")


def format_of(config: dict, where: Path | str) -> Format | None:
    """The block format a model's config.json declares (None: not quantized); one it does not know is refused."""
    entry = config.get(CONFIG_KEY)
    if entry is None:
        return None
    name = entry.get("format") if isinstance(entry, dict) else None
    block = entry.get("block_size") if isinstance(entry, dict) else None
    if name not in FORMATS or block != BLOCK:
        raise InputError(f"{where}'s config.json declares {CONFIG_KEY} {entry!r}; this toolkit reads "
                         f"{', '.join(FORMATS)} with block_size {BLOCK}: quantize the 16-bit model again "
                         f"(python -m decode.quantize)")
    return FORMATS[name]


def checkpoint_blocks(model_dir, config: dict, quantization: Format | None) -> tuple[Format, Callable[[], dict]] | None:
    """How a model's tensors in blocks are read, as (their format, the reader of a quantized checkpoint's tensors):
    a quantized checkpoint's from its file; a 16-bit one's quantized to `quantization` as it loads. None: a 16-bit
    model loaded as it is."""
    from decode.models.pretrained import load_safetensors
    from decode.models.quantize_model import checkpoint_in_blocks  # (it reads the engines' checkpoint names)

    stored = format_of(config, model_dir)
    if stored is not None and quantization is not None:
        raise InputError(f"{model_dir} is a {stored.name} checkpoint already; quantize as it loads ({quantization.name}) "
                         f"only a 16-bit model: pass the 16-bit model's directory, or a dtype")
    if stored is not None:
        return stored, lambda: load_safetensors(model_dir)
    if quantization is not None:
        return quantization, lambda: checkpoint_in_blocks(Path(model_dir), config, quantization)
    return None


def format_name(fmt: Format | None) -> str | None:
    """A block format's name, as results record it (None: not quantized)."""
    return fmt.name if fmt else None


def dtype_and_format(precision: str, dtype: str) -> tuple[str, Format | None]:
    """A precision a model is asked for in, a dtype or a block format (whose model then computes in `dtype`), as the
    dtype it computes in and the format its matrices are quantized to as it loads (None: as stored)."""
    return (dtype, FORMATS[precision]) if precision in FORMATS else (precision, None)


def config_entry(fmt: Format) -> dict:
    return {"format": fmt.name, "block_size": BLOCK}


def split_checkpoint(tensors: dict[str, torch.Tensor], fmt: Format, where: Path | str
                     ) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedMatrix]]:
    """A quantized checkpoint's tensors as (dense tensors by name, quantized matrices by the name of the weight they
    stand for); a matrix with quants and no scales (or the reverse) is refused."""
    quantized = {}
    names = {name.rsplit(".", 1)[0] for name in tensors if name.endswith((".quants", ".scales"))}
    for name in names:
        quants, scales = tensors.get(f"{name}.quants"), tensors.get(f"{name}.scales")
        if quants is None or scales is None:
            raise InputError(f"{where}/{QUANTIZED_FILE} holds {name}'s "
                             f"{'quants' if scales is None else 'scales'} without its "
                             f"{'scales' if scales is None else 'quants'}: quantize the model again (python -m decode.quantize)")
        matrix = QuantizedMatrix(fmt, quants, scales)
        matrix.check(f"{where}/{QUANTIZED_FILE}: {name}")
        quantized[name] = matrix
    dense = {name: t for name, t in tensors.items() if not name.endswith((".quants", ".scales"))}
    return dense, quantized


def quantized_tensors(weights: dict[str, torch.Tensor], quantize: Callable[[str], bool], fmt: Format,
                      orient: Callable[[str, torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors as a quantized checkpoint's: each weight `quantize(name)` selects, oriented (out, in) by
    `orient(name, tensor)`, as NAME.quants and NAME.scales; the others as float32."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if quantize(name):
            matrix = QuantizedMatrix.quantize(orient(name, tensor), fmt)
            out |= {f"{name}.quants": matrix.quants, f"{name}.scales": matrix.scales}
        else:
            out[name] = tensor.to(torch.float32).contiguous()
    return out

