"""A lean Llama-family model (Llama, Qwen2, Mistral) over the weights of a Hugging Face checkpoint: RMS norms, rotary
positions, grouped-query attention, SwiGLU MLPs, an output layer tied to the embeddings or its own, Qwen2's q/k/v
biases. Its C++ forward of a few rows is GPT-2's (decode/native/forward.cpp, architecture 1); torch's forward is a
handful of ops per layer, as transformers' modeling_llama computes them.

The rotary angles come from transformers' own rotary embedding, so every `rope_scaling` it computes up front
(default, linear, llama3, yarn) gives its cosines and sines here; one that changes with the sequence's length
(dynamic, longrope) runs on the transformers backend.
"""
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from decode.errors import InputError
from decode.models.kv_slots import KVSlots
from decode.models.lean_engine import DTYPES, SPECULATIVE_SLOTS, LeanEngine, on_device, torch_weights_on_first_use
from decode.models.projection import LAYOUTS, Projection
from decode.models.quantized import Format, QuantizedMatrix, split_checkpoint
from decode.models.runtime import runtime_for
from decode.shortlist import Shortlist
from decode.tensors import Ids, as_tensor

MODEL_TYPES = ("llama", "qwen2", "mistral")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # computed once, not per sequence length
# The context the engine holds where the config allows more: its cache takes slots for every position up front
DEFAULT_CONTEXT = 8192
# Hub models' shapes, by name: the config.json fields that set what a forward costs (decode.shaped, bench_engine --shape)
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                     "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
                     "tie_word_embeddings": True},
    "qwen2.5-0.5b": {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                     "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                     "tie_word_embeddings": True},
    "llama-3.2-1b": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                     "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                     "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                     "tie_word_embeddings": True},
}


@dataclass(frozen=True)
class LlamaShape:
    vocab_size: int
    n_positions: int  # the context the engine holds (the config's, at most its sliding window)
    n_layer: int
    n_head: int
    n_kv_head: int
    head_dim: int
    n_embd: int
    intermediate: int
    epsilon: float
    tied: bool  # the output layer is the embeddings

    @classmethod
    def from_config(cls, config: dict) -> "LlamaShape":
        heads = config["num_attention_heads"]
        positions = config.get("max_position_embeddings", DEFAULT_CONTEXT)
        window = config.get("sliding_window") if config.get("model_type") == "mistral" else None
        return cls(config["vocab_size"], min(positions, window or positions), config["num_hidden_layers"], heads,
                   config.get("num_key_value_heads") or heads, config.get("head_dim") or config["hidden_size"] // heads,
                   config["hidden_size"], config["intermediate_size"], config.get("rms_norm_eps", 1e-6),
                   config.get("tie_word_embeddings", False))

    @property
    def block_weights(self) -> int:
        """Weights a block's four products read."""
        q, kv = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        return self.n_embd * (q + 2 * kv) + q * self.n_embd + 3 * self.n_embd * self.intermediate

    @property
    def kv_width(self) -> int:
        return self.n_kv_head * self.head_dim


def random_checkpoint(config: dict, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Random weights for a Llama-family config, named as in its checkpoint: a model whose forward costs what a
    trained one's of that shape does (norms of ones, Qwen2's q/k/v biases zeros)."""
    shape = LlamaShape.from_config(config)
    e, q, kv, inner = shape.n_embd, shape.n_head * shape.head_dim, shape.kv_width, shape.intermediate
    shapes = {"model.embed_tokens.weight": (shape.vocab_size, e), "model.norm.weight": (e,)}
    if not shape.tied:
        shapes["lm_head.weight"] = (shape.vocab_size, e)
    for i in range(shape.n_layer):
        block = {"input_layernorm.weight": (e,), "post_attention_layernorm.weight": (e,),
                 "self_attn.q_proj.weight": (q, e), "self_attn.k_proj.weight": (kv, e),
                 "self_attn.v_proj.weight": (kv, e), "self_attn.o_proj.weight": (e, q), "mlp.gate_proj.weight": (inner, e),
                 "mlp.up_proj.weight": (inner, e), "mlp.down_proj.weight": (e, inner)}
        if config["model_type"] == "qwen2":
            block |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
        shapes |= {f"model.layers.{i}.{name}": size for name, size in block.items()}
    return {name: torch.ones(size, dtype=dtype) if "norm" in name else
            (torch.zeros(size, dtype=dtype) if name.endswith("bias") else 0.02 * torch.randn(size, dtype=dtype))
            for name, size in shapes.items()}


def rope_type(config: dict) -> str:
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def unsupported(config: dict) -> str | None:
    """Why the lean engine cannot run this Llama-family config (None: it can): the feature named, as a user would
    look it up in config.json."""
    kind = config.get("model_type")
    if kind not in MODEL_TYPES:
        return f"its model_type {kind!r} is not one of {', '.join(MODEL_TYPES)}"
    if config.get("hidden_act", "silu") != "silu":
        return f"its hidden_act {config['hidden_act']!r} is not silu"
    if rope_type(config) not in ROPE_TYPES:
        return f"its rope type {rope_type(config)!r} is not one of {', '.join(ROPE_TYPES)}"
    if kind == "qwen2" and config.get("use_sliding_window"):
        return "it uses sliding-window attention (use_sliding_window)"
    if config.get("num_local_experts") or config.get("num_experts"):
        return "it is a mixture of experts"
    return None


def rotary_embedding(config: dict):
    """transformers' rotary embedding of this config (every rope type it computes)."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(AutoConfig.for_model(**config))  # type: ignore[arg-type]  # (the family's fields)


def rotary_inverse_frequencies(config: dict) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The rotary angles' inverse frequencies under the config's rope scaling, those without it, and its base."""
    rotary = rotary_embedding(config)
    default, _ = rotary.compute_default_rope_parameters(rotary.config)
    return rotary.inv_freq, default, float(rotary.config.rope_parameters["rope_theta"])


def rotary_tables(config: dict, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (positions, head_dim / 2) cosines and sines of each position's rotary angles, as transformers' rotary
    embedding computes them for this config (its attention scaling included)."""
    cos, sin = rotary_embedding(config)(torch.zeros(1), torch.arange(positions)[None])
    half = cos.shape[-1] // 2
    return cos[0, :, :half].contiguous(), sin[0, :, :half].contiguous()


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions applied to (heads, q, head_dim) vectors, cos and sin (q, head_dim / 2) in their dtype: element
    i and i + head_dim / 2 turn together, as transformers' rotate_half pairs them."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


# A block's matrices: the checkpoint's projections each fuses, by the names the C++ forward knows them under
FUSED = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "attn_out": ("self_attn.o_proj",),
         "mlp_in": ("mlp.gate_proj", "mlp.up_proj"), "mlp_out": ("mlp.down_proj",)}


def fused(weights: dict[str, torch.Tensor], i: int, take: Callable[[str], "torch.Tensor | QuantizedMatrix"]) -> dict:
    """Block i's four matrices, each of FUSED's projections' output rows one after another's (in, out), or (out, in)
    in a quantized model's blocks, and their biases where the checkpoint has any (zeros for the projections without),
    by the C++ forward's names (h.{i}.qkv, h.{i}.qkv.bias)."""
    tensors: dict = {}
    for name, parts in FUSED.items():
        matrices = [take(f"layers.{i}.{part}.weight") for part in parts]
        blocks = [m for m in matrices if isinstance(m, QuantizedMatrix)]
        tensors[f"h.{i}.{name}"] = (QuantizedMatrix.stacked(blocks) if blocks else
                                    torch.cat([m for m in matrices if isinstance(m, torch.Tensor)]).T)
        biases = [weights.get(f"layers.{i}.{part}.bias") for part in parts]
        present = [b for b in biases if b is not None]
        if present:
            tensors[f"h.{i}.{name}.bias"] = torch.cat([present[0].new_zeros(m.shape[0]) if b is None else b
                                                       for b, m in zip(biases, matrices)])
    return tensors


def dequantized_checkpoint(tensors: dict[str, torch.Tensor], fmt: Format, where) -> dict[str, torch.Tensor]:
    """A quantized Llama-family checkpoint's tensors (read from `where`), every matrix dequantized to float32: the
    model torch's forward (or transformers') computes."""
    dense, quantized = split_checkpoint(tensors, fmt, where)
    return dense | {name: matrix.dequantize() for name, matrix in quantized.items()}


@dataclass
class LlamaLayer:
    """One block's weights for torch's forward: its two RMS norms' weights and its four fused projections."""

    norm_1: torch.Tensor
    qkv: Projection
    attn_out: Projection
    norm_2: torch.Tensor
    mlp_in: Projection  # gate, then up
    mlp_out: Projection


class LlamaEngine(LeanEngine):
    def __init__(self, shape: LlamaShape, cos: torch.Tensor, sin: torch.Tensor, norm: torch.Tensor,
                 torch_weights: Callable[[], tuple[list[LlamaLayer], Projection, torch.Tensor]],
                 layouts: dict[str, str], kv: KVSlots, max_length: int, runtime, shortlist: Shortlist | None = None):
        """A Llama-family model over its weights (`build` makes them from a checkpoint's): LeanEngine's, its rotary
        tables `cos`, `sin` (float32, positions x head_dim / 2) and final norm's weight besides."""
        super().__init__(shape, torch_weights, layouts, kv, max_length, runtime, shortlist)
        self.norm = norm
        self.cos, self.sin = cos.to(norm.device), sin.to(norm.device)

    @classmethod
    def build(cls, config: dict, weights: dict[str, torch.Tensor], dtype: str = "float32",
              device: str | torch.device = "cpu", max_length: int | None = None, layout: str | None = None,
              cuda_graphs: bool = False, shortlist: Shortlist | None = None, native_blocks: bool = False,
              calibrate: bool = False, reload: Callable[[], dict[str, torch.Tensor]] | None = None,
              quantized: dict[str, QuantizedMatrix] | None = None, compile_layers: bool = False) -> "LlamaEngine":
        """From a Llama-family config and its weights as named in a Hugging Face checkpoint: as GPT2Engine.build
        (the same runtime, layouts, shortlist, C++ forward, `reload`, `quantized` matrices, by checkpoint name, and
        `compile_layers`);
        the context is the config's positions, at most DEFAULT_CONTEXT unless `max_length` asks for more."""
        why = unsupported(config)
        if why is not None:
            raise InputError(f"the lean engine cannot run this model: {why}; use the transformers backend (--backend hf)")
        if layout not in (None, *LAYOUTS):
            raise InputError(f"weight layout {layout!r}: choose one of {', '.join(LAYOUTS)} (or none: measured)")
        shape, device, torch_dtype = LlamaShape.from_config(config), torch.device(device), DTYPES[dtype]
        max_length = min(max_length or DEFAULT_CONTEXT, shape.n_positions)
        quantization = next(iter(quantized.values())).format if quantized else None
        runtime = runtime_for(device, torch_dtype, native_blocks, cuda_graphs, quantization, compile_layers)
        fits = runtime.loads_forward(shape.n_embd) and shape.intermediate % 16 == 0 and shape.head_dim % 2 == 0
        lazy = fits and reload is not None
        convert = lambda checkpoint, take: on_device(checkpoint, take, "model.", device, torch_dtype)
        embedded_in_head = fits and shortlist is None and shape.tied  # the C++ looks the embeddings up in its output layer
        if quantized:  # torch's forward computes with every matrix dequantized, the embeddings looked up so
            for name in list(quantized):  # renamed in place: a matrix the C++ takes out is then held nowhere else
                quantized[name.removeprefix("model.")] = quantized.pop(name)
            if not lazy:
                weights = weights | {name: matrix.dequantize() for name, matrix in quantized.items()}
        weights = convert(weights, weights.pop if lazy else weights.__getitem__)
        rows = slice(shape.vocab_size) if shortlist is None else shortlist.tokens_on(device)

        def embeddings(checkpoint: dict) -> torch.Tensor:
            # a config that pads the output past the tokenizer's tokens (load's `tokens`): the padded rows are left out
            return checkpoint["embed_tokens.weight"][: shape.vocab_size]

        def output_of(checkpoint: dict):
            """The output layer's (columns, n_embd) weight, in the model's dtype or in blocks: the untied head's rows,
            or the embeddings'."""
            head = checkpoint.get("lm_head.weight") if not shape.tied else None
            matrix = checkpoint["embed_tokens.weight"] if head is None else head
            return matrix.rows(rows) if isinstance(matrix, QuantizedMatrix) else matrix[: shape.vocab_size][rows]

        columns = shape.vocab_size if shortlist is None else len(shortlist.tokens)
        e, q, kv = shape.n_embd, shape.n_head * shape.head_dim, shape.kv_width
        matrices = {"qkv": (e, q + 2 * kv), "attn_out": (q, e), "mlp_in": (e, 2 * shape.intermediate),
                    "mlp_out": (shape.intermediate, e), "head": (e, columns)}  # (in, out)
        layouts = {name: layout or runtime.layout(*matrix, False, calibrate) for name, matrix in matrices.items()}
        pad_rows = runtime.pads_rows()

        def torch_weights(checkpoint: dict[str, torch.Tensor]) -> tuple[list[LlamaLayer], Projection, torch.Tensor]:
            def layer(i: int) -> LlamaLayer:
                block = fused(checkpoint, i, checkpoint.__getitem__)
                p = {name: Projection(block[f"h.{i}.{name}"], block.get(f"h.{i}.{name}.bias"), layouts[name],
                                      pad_rows=pad_rows) for name in FUSED}
                return LlamaLayer(checkpoint[f"layers.{i}.input_layernorm.weight"], p["qkv"], p["attn_out"],
                                  checkpoint[f"layers.{i}.post_attention_layernorm.weight"], p["mlp_in"], p["mlp_out"])

            head = Projection(output_of(checkpoint).T, None, layouts["head"], pad_rows=pad_rows)
            return [layer(i) for i in range(shape.n_layer)], head, embeddings(checkpoint)

        cos, sin = rotary_tables(config, max_length)
        kv_slots = KVSlots(shape.n_layer, shape.n_kv_head, shape.head_dim, max_length + SPECULATIVE_SLOTS, torch_dtype,
                           device, runtime.mover)
        make_torch_weights = torch_weights_on_first_use(None if lazy else torch_weights(weights), reload, convert,
                                                        torch_weights)
        if fits:
            held = quantized or weights  # the matrices, in blocks or in the model's dtype
            take = held.pop if lazy else held.__getitem__
            output = output_of(quantized or weights)
            tensors: dict[str, torch.Tensor | QuantizedMatrix] = {"rope.cos": cos, "rope.sin": sin,
                                                                  "norm_f.weight": weights["norm.weight"]}
            if not embedded_in_head:  # a quantized model's in their blocks, dequantized as the C++ reads them
                tensors |= ({"embeddings": quantized["embed_tokens.weight"].rows(slice(shape.vocab_size))} if quantized
                            else {"wte": embeddings(weights)})
            for i in range(shape.n_layer):
                tensors |= {f"h.{i}.norm_1.weight": weights[f"layers.{i}.input_layernorm.weight"],
                            f"h.{i}.norm_2.weight": weights[f"layers.{i}.post_attention_layernorm.weight"]}
                tensors |= fused(weights, i, take)
            runtime.load_forward({"architecture": 1, "n_embd": e, "heads": shape.n_head, "kv_heads": shape.n_kv_head,
                                  "head_dim": shape.head_dim, "intermediate": shape.intermediate,
                                  "layers": shape.n_layer, "epsilon": shape.epsilon},
                                 tensors, output, consume=lazy)
        return cls(shape, cos, sin, weights["norm.weight"], make_torch_weights, layouts, kv_slots, max_length, runtime,
                   shortlist)

    why_not = staticmethod(unsupported)
    quantized_names = staticmethod(lambda config: ["model.embed_tokens.weight"])  # (its matrices: pack_checkpoint's)
    dequantized_checkpoint = staticmethod(dequantized_checkpoint)

    def torch_logits(self, token_ids: Ids, position_ids: Ids, mask: torch.Tensor | None,
                     slots: slice | torch.Tensor, end: int, last: int | None = None) -> torch.Tensor:
        """`logits` through torch's operations."""
        token_ids, position_ids = as_tensor(token_ids, self.device), as_tensor(position_ids, self.device)
        x = F.embedding(token_ids, self.embedding)
        cos, sin = self.cos[position_ids].to(self.dtype), self.sin[position_ids].to(self.dtype)
        with self.runtime.attention():
            x = self.layers_forward(x, cos, sin, self.additive(mask, end), slots, end)
        if last is not None:
            x = x[x.shape[0] - last :]
        return self.head(rms_norm(x, self.norm, self.shape.epsilon)).float()

    def layers_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                       slots: slice | torch.Tensor, end: int) -> torch.Tensor:
        """The transformer blocks over q new nodes, writing their keys/values into cache `slots`."""
        block = self.runtime.layer(llama_block)
        for layer, cache in zip(self.layers, self.kv.layers):
            x = block(x, layer, cache, cos, sin, mask, slots, end, self.shape)
        return x


def llama_block(x: torch.Tensor, layer: LlamaLayer, cache: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, slots: slice | torch.Tensor, end: int, s: LlamaShape) -> torch.Tensor:
    """One block over q new nodes `x`, writing their keys/values into its `cache`'s `slots` and attending to slots
    0..end under `mask`."""
    q = x.shape[0]
    widths = (s.n_head * s.head_dim, s.kv_width, s.kv_width)
    h = rms_norm(x, layer.norm_1, s.epsilon)
    queries, keys, values = (part.view(q, -1, s.head_dim).transpose(0, 1) for part in layer.qkv(h).split(widths, dim=-1))
    cache[0, :, slots] = rotated(keys, cos, sin)
    cache[1, :, slots] = values
    att = F.scaled_dot_product_attention(rotated(queries, cos, sin)[None], cache[None, 0, :, :end],
                                         cache[None, 1, :, :end], attn_mask=mask, enable_gqa=True)[0]
    x = x + layer.attn_out(att.transpose(0, 1).reshape(q, widths[0]))
    gate, up = layer.mlp_in(rms_norm(x, layer.norm_2, s.epsilon)).chunk(2, dim=-1)
    return x + layer.mlp_out(F.silu(gate) * up)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Llama's RMSNorm: in float32, then scaled by the weight in x's dtype."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=epsilon).to(x.dtype)
