"""A lean GPT-2 over the weights of a Hugging Face checkpoint: its C++ forward of a few rows, or a handful of torch
ops per layer.

Why it exists: on a small model, transformers spends several milliseconds per call in framework code; decoding makes
hundreds of calls per prompt. This engine does the same arithmetic with a preallocated KV cache (decode.models.
lean_engine, which it shares with the Llama family's).
"""
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from decode.errors import InputError
from decode.models.kv_slots import KVSlots
from decode.models.lean_engine import DTYPES, SPECULATIVE_SLOTS, LeanEngine, on_device, torch_weights_on_first_use
from decode.models.pretrained import FUSED_GELU
from decode.models.projection import LAYOUTS, Projection
from decode.models.quantized import Format, QuantizedMatrix, split_checkpoint
from decode.models.runtime import Runtime, runtime_for
from decode.shortlist import Shortlist
from decode.tensors import Ids, as_tensor


@dataclass(frozen=True)
class GPT2Shape:
    vocab_size: int
    n_positions: int
    n_layer: int
    n_head: int
    n_embd: int
    layer_norm_epsilon: float

    @classmethod
    def from_config(cls, config: dict) -> "GPT2Shape":
        return cls(*(config[f] for f in ("vocab_size", "n_positions", "n_layer", "n_head", "n_embd", "layer_norm_epsilon")))

    @property
    def block_weights(self) -> int:
        """Weights a block's four products read."""
        return 12 * self.n_embd * self.n_embd

    @property
    def kv_width(self) -> int:
        return self.n_embd


def is_lean_compatible(config: dict) -> bool:
    """The lean engine implements GPT-2 exactly as configured by default (tanh GELU, no attention variants)."""
    return (
        config.get("model_type") == "gpt2"
        and config.get("activation_function", "gelu_new") in ("gelu_new", FUSED_GELU)
        and not config.get("scale_attn_by_inverse_layer_idx", False)
        and not config.get("reorder_and_upcast_attn", False)
        and config.get("tie_word_embeddings", True)
    )


def layer_norm(x: torch.Tensor, weight_bias: tuple[torch.Tensor, torch.Tensor], epsilon: float) -> torch.Tensor:
    """F.layer_norm over the last dimension with a (weight, bias) pair."""
    weight, bias = weight_bias
    return F.layer_norm(x, weight.shape, weight, bias, epsilon)


# A block's matrices: their checkpoint names and the names their layouts go by
LINEAR = {"attn.c_attn": "qkv", "attn.c_proj": "attn_out", "mlp.c_fc": "mlp_in", "mlp.c_proj": "mlp_out"}


@dataclass
class LayerWeights:
    """One transformer block's weights: its layer norms (weight, bias) and its four projections."""

    ln_1: tuple[torch.Tensor, torch.Tensor]
    qkv: Projection  # attn.c_attn
    attn_out: Projection  # attn.c_proj
    ln_2: tuple[torch.Tensor, torch.Tensor]
    mlp_in: Projection  # mlp.c_fc, with GPT-2's GELU
    mlp_out: Projection  # mlp.c_proj

    @classmethod
    def from_checkpoint(cls, weights: dict[str, torch.Tensor], i: int, projection: Callable) -> "LayerWeights":
        """Block i of a Hugging Face GPT-2 checkpoint's weights; `projection(in_out, bias, gelu, name)` makes each
        product (`name`: the checkpoint's, e.g. attn.c_attn)."""
        w = lambda name: weights[f"h.{i}.{name}"]
        linear = lambda name, gelu=False: projection(w(f"{name}.weight"), w(f"{name}.bias"), gelu, name)
        return cls((w("ln_1.weight"), w("ln_1.bias")), linear("attn.c_attn"), linear("attn.c_proj"),
                   (w("ln_2.weight"), w("ln_2.bias")), linear("mlp.c_fc", gelu=True), linear("mlp.c_proj"))

    def projections(self) -> tuple[Projection, ...]:
        return self.qkv, self.attn_out, self.mlp_in, self.mlp_out


def dequantized_matrices(quantized: dict[str, QuantizedMatrix]) -> dict[str, torch.Tensor]:
    """A quantized GPT-2's matrices in float32 as a 16-bit checkpoint holds them: wte (vocabulary, n_embd), the
    blocks' (in, out) as its Conv1D layers hold them."""
    return {name: matrix.dequantize() if name == "wte.weight" else matrix.dequantize().T for name, matrix in quantized.items()}


def dequantized_checkpoint(tensors: dict[str, torch.Tensor], fmt: Format, where) -> dict[str, torch.Tensor]:
    """A quantized GPT-2 checkpoint's tensors (read from `where`) as a 16-bit checkpoint names them (without
    "transformer."), every matrix dequantized to float32: the model torch's forward (or transformers') computes."""
    dense, quantized = split_checkpoint(tensors, fmt, where)
    return dense | dequantized_matrices(quantized)


def cpp_tensors(weights: dict[str, torch.Tensor], n_layer: int, take: Callable[[str], "torch.Tensor | QuantizedMatrix"]
                ) -> dict:
    """A GPT-2 checkpoint's tensors (names without "transformer.") by the C++ forward's names (native.Blocks), but
    for its token embeddings, each block's matrices taken out with `take`."""
    tensors: dict[str, torch.Tensor | QuantizedMatrix] = {"wpe": weights["wpe.weight"], "norm_f.weight": weights["ln_f.weight"],
                                                          "norm_f.bias": weights["ln_f.bias"]}
    for i in range(n_layer):
        for k in (1, 2):
            tensors |= {f"h.{i}.norm_{k}.{part}": weights[f"h.{i}.ln_{k}.{part}"] for part in ("weight", "bias")}
        for name, matrix in LINEAR.items():
            tensors |= {f"h.{i}.{matrix}": take(f"h.{i}.{name}.weight"), f"h.{i}.{matrix}.bias": weights[f"h.{i}.{name}.bias"]}
    return tensors


class GPT2Engine(LeanEngine):
    def __init__(self, shape: GPT2Shape, wpe: torch.Tensor,
                 torch_weights: Callable[[], tuple[list[LayerWeights], Projection, torch.Tensor]], layouts: dict[str, str],
                 ln_f: tuple[torch.Tensor, torch.Tensor], kv: KVSlots, max_length: int, runtime: Runtime,
                 shortlist: Shortlist | None = None):
        """GPT-2 over its weights (`build` makes them from a checkpoint's): LeanEngine's, its position embeddings
        `wpe` and its final layer norm `ln_f` besides."""
        super().__init__(shape, torch_weights, layouts, kv, max_length, runtime, shortlist)
        self.wpe, self.ln_f = wpe, ln_f

    @classmethod
    def build(cls, config: dict, weights: dict[str, torch.Tensor], dtype: str = "float32", device: str | torch.device = "cpu",
              max_length: int | None = None, layout: str | None = None, cuda_graphs: bool = False,
              shortlist: Shortlist | None = None, native_blocks: bool = False, calibrate: bool = False,
              reload: Callable[[], dict[str, torch.Tensor]] | None = None,
              quantized: dict[str, QuantizedMatrix] | None = None, compile_layers: bool = False) -> "GPT2Engine":
        """From a GPT-2 config and its weights as named in a Hugging Face checkpoint, run by the device's runtime
        (runtime_for). `layout` (one of LAYOUTS) stores every matrix in that layout; by default each matrix gets its
        shape's calibrated layout (measured now with `calibrate`; decode.models.projection.layout_for). On a GPU with
        `cuda_graphs`, forwards replay CUDA graphs; with `compile_layers`, torch's forward computes its layers through
        torch.compile (Runtime.layer). With a `shortlist`, the output layer computes the logits of its
        tokens only. With `native_blocks`, an engine on a CPU with AVX2 and FMA or AVX-512 runs a forward of a few
        rows (up to native.Blocks.ROWS, or the runtime's `rows` once measured) as one C++ call (forward.cpp), which
        rounds differently from torch's; `reload()` then gives the checkpoint's weights again, and the C++ call takes
        the matrices out of `weights` (read for this engine alone) as it packs them, torch's forward making its own
        from `reload()` on its first use. A quantized model's matrices come in `quantized` (wte and the blocks'
        four, by checkpoint name), the rest in `weights`: the C++ forward computes with their blocks, torch's forward
        with them dequantized to `dtype` (`reload()` then gives the dequantized checkpoint). Where the C++ forward's
        output layer is the whole vocabulary's (no shortlist), it looks the embeddings up there, else in a quantized
        model's blocks (or wte): the engine holds no other copy of them."""
        if layout not in (None, *LAYOUTS):
            raise InputError(f"weight layout {layout!r}: choose one of {', '.join(LAYOUTS)} (or none: measured)")
        shape, device, torch_dtype = GPT2Shape.from_config(config), torch.device(device), DTYPES[dtype]
        quantization = next(iter(quantized.values())).format if quantized else None
        runtime = runtime_for(device, torch_dtype, native_blocks, cuda_graphs, quantization, compile_layers)
        fits = runtime.loads_forward(shape.n_embd)
        lazy = fits and reload is not None
        # taken out of a checkpoint read for this engine alone (`reload`), so that it holds no matrix the C++ packed
        convert = lambda checkpoint, take: on_device(checkpoint, take, "transformer.", device, torch_dtype)
        embedded_in_head = fits and shortlist is None  # the C++ looks the embeddings up in its output layer
        if quantized and not lazy:  # torch's forward computes with every matrix dequantized
            weights = weights | dequantized_matrices(quantized)
        weights = convert(weights, weights.pop if lazy else weights.__getitem__)
        pad_rows = runtime.pads_rows()
        e = shape.n_embd
        rows = slice(shape.vocab_size) if shortlist is None else shortlist.tokens_on(device)
        columns = shape.vocab_size if shortlist is None else len(shortlist.tokens)
        matrices = {"qkv": (e, 3 * e), "attn_out": (e, e), "mlp_in": (e, 4 * e), "mlp_out": (4 * e, e),
                    "head": (e, columns)}  # (in, out)
        layouts = {name: layout or runtime.layout(*matrix, name == "mlp_in", calibrate)
                   for name, matrix in matrices.items()}

        def embeddings(checkpoint: dict) -> torch.Tensor:
            # a config that pads the output past the tokenizer's tokens (load's `tokens`): the padded rows are left out
            return checkpoint["wte.weight"][: shape.vocab_size]

        def torch_weights(checkpoint: dict[str, torch.Tensor]) -> tuple[list[LayerWeights], Projection, torch.Tensor]:
            def projection(in_out: torch.Tensor, bias: torch.Tensor | None, gelu: bool, name: str) -> Projection:
                return Projection(in_out, bias, layouts[LINEAR.get(name, name)], gelu, pad_rows)

            wte = embeddings(checkpoint)
            return ([LayerWeights.from_checkpoint(checkpoint, i, projection) for i in range(shape.n_layer)],
                    projection(wte[rows].T, None, False, "head"), wte)

        max_length = max_length or shape.n_positions  # positions: the context
        # slots: a tree's nodes share positions
        kv = KVSlots(shape.n_layer, shape.n_head, shape.n_embd // shape.n_head, max_length + SPECULATIVE_SLOTS,
                     torch_dtype, device, runtime.mover)
        make_torch_weights = torch_weights_on_first_use(None if lazy else torch_weights(weights), reload, convert, torch_weights)
        cpp_shape = {"architecture": 0, "n_embd": e, "heads": shape.n_head, "layers": shape.n_layer,
                     "epsilon": shape.layer_norm_epsilon}
        if fits:  # (lazy: the matrices leave `quantized` or `weights` as the C++ packs them)
            held = quantized or weights
            take = held.pop if lazy else held.__getitem__
            embedded = take("wte.weight")  # GPT-2's output layer is its embeddings
            head: torch.Tensor | QuantizedMatrix
            own: dict[str, torch.Tensor | QuantizedMatrix]
            if isinstance(embedded, QuantizedMatrix):  # in their blocks, dequantized as the C++ reads them
                head, own = embedded.rows(rows), {"embeddings": embedded.rows(slice(shape.vocab_size))}
            else:
                head, own = embedded[: shape.vocab_size][rows], {"wte": embedded[: shape.vocab_size]}
            tensors = cpp_tensors(weights, shape.n_layer, take) | ({} if embedded_in_head else own)
            runtime.load_forward(cpp_shape, tensors, head, consume=lazy)  # (each matrix goes as it is packed)
        return cls(shape, weights["wpe.weight"], make_torch_weights, layouts, (weights["ln_f.weight"], weights["ln_f.bias"]),
                   kv, max_length, runtime, shortlist)

    @staticmethod
    def why_not(config: dict) -> str | None:
        if config.get("model_type") != "gpt2":
            return f"its model_type {config.get('model_type')!r} is not gpt2"
        if not is_lean_compatible(config):
            return "its GPT-2 options (activation, attention variants or an untied head) are not the ones the lean engine implements"
        return None

    @staticmethod
    def quantized_names(config: dict) -> list[str]:
        return ["wte.weight", *(f"h.{i}.{name}.weight" for i in range(config["n_layer"]) for name in LINEAR)]

    dequantized_checkpoint = staticmethod(dequantized_checkpoint)

    def torch_logits(self, token_ids: Ids, position_ids: Ids, mask: torch.Tensor | None,
                     slots: slice | torch.Tensor, end: int, last: int | None = None) -> torch.Tensor:
        """`logits` through torch's operations."""
        token_ids, position_ids = as_tensor(token_ids, self.device), as_tensor(position_ids, self.device)
        # F.embedding (an index_select) runs faster than indexing the matrices
        x = F.embedding(token_ids, self.embedding) + F.embedding(position_ids, self.wpe)
        with self.runtime.attention():
            x = self.layers_forward(x, self.additive(mask, end), slots, end)
        if last is not None:
            x = x[x.shape[0] - last :]
        x = layer_norm(x, self.ln_f, self.shape.layer_norm_epsilon)
        return self.head(x).float()

    def layers_forward(self, x: torch.Tensor, mask: torch.Tensor | None, slots: slice | torch.Tensor, end: int
                       ) -> torch.Tensor:
        """The transformer blocks over q new nodes, writing their keys/values into cache `slots`."""
        block = self.runtime.layer(gpt2_block)
        for layer, cache in zip(self.layers, self.kv.layers):
            x = block(x, layer, cache, mask, slots, end, self.shape)
        return x


def gpt2_block(x: torch.Tensor, layer: LayerWeights, cache: torch.Tensor, mask: torch.Tensor | None,
               slots: slice | torch.Tensor, end: int, s: GPT2Shape) -> torch.Tensor:
    """One block over q new nodes `x`, writing their keys/values into its `cache`'s `slots` and attending to slots
    0..end under `mask`."""
    q = x.shape[0]
    h = layer_norm(x, layer.ln_1, s.layer_norm_epsilon)
    qkv = layer.qkv(h).view(q, 3, s.n_head, s.n_embd // s.n_head).permute(1, 2, 0, 3)
    cache[:, :, slots] = qkv[1:]
    keys, values = cache[:, None, :, :end]
    # a batch dimension and a contiguous query let torch pick its fused attention kernel
    att = F.scaled_dot_product_attention(qkv[0].contiguous()[None], keys, values, attn_mask=mask)[0]
    x = x + layer.attn_out(att.transpose(0, 1).reshape(q, s.n_embd))
    h = layer_norm(x, layer.ln_2, s.layer_norm_epsilon)
    return x + layer.mlp_out(layer.mlp_in(h))  # mlp_in applies the GELU
