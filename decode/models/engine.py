"""A lean GPT-2 forward in plain torch over the weights of a Hugging Face checkpoint.

Why it exists: on a small model, transformers spends several milliseconds per call in framework
code; decoding makes hundreds of calls per prompt. This engine does the same arithmetic with a
preallocated KV cache and a handful of torch ops per layer.

The cache holds `length` committed positions followed by `pending` speculative ones. `forward`
scores new nodes (any tree: the caller gives positions and a mask over the pending slots plus the
new nodes; committed positions are always visible), appends their keys/values to the speculative
region, and returns their logits. `commit` keeps an ordered subset of the speculative slots (the
accepted path) and drops the rest.
"""
import contextlib
import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from data.errors import InputError
from data.pretrained import FUSED_GELU, RETRAIN, load_safetensors
from decode import native
from decode.models.cached_lm import CachedLM, Ids, Shortlist, as_tensor
from decode.models.cuda_graphs import CUDAGraphs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SPECULATIVE_SLOTS = 2048  # cache slots beyond the context for the nodes of a speculative tree
# cuDNN's attention builds a plan for every new shape, and each decoding call has a new cached length: measured
# on an H100 (cpu-preset oracle, bfloat16), greedy decoding ran at 17 tokens/s with it and 260 without
ATTENTION_WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
LINEAR_LAYERS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
# On a CPU in bfloat16, oneDNN builds a kernel for every new number of rows a matrix is multiplied with: 1-4 ms a
# matrix, a first prompt of a new length cost 8 ms more than a second on the cpu preset's oracle (5 on its draft;
# AMX CPU). Products of more than PAD_ABOVE rows (prompts; the trees a step scores are smaller) are padded to a
# multiple of ROW_BLOCK, so prompts of any length share a few kernels.
PAD_ABOVE, ROW_BLOCK = 64, 32


def attention_kernels(device: torch.device):
    """A context for transformers' models (the backend, the peers): on a GPU, SDPA without cuDNN's attention, as the
    lean engine runs (its forward checks the device itself: a context per call costs on a CPU). cuDNN's builds a plan
    per new cached length, which made generate several times slower in a fresh process (docs/gpu.md)."""
    return sdpa_kernel(ATTENTION_WITHOUT_CUDNN) if device.type == "cuda" else contextlib.nullcontext()


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


def read_config(model_dir) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise InputError(f"{model_dir} is not a model directory (no config.json); pass a directory written by save_pretrained")
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"{path} is not a valid JSON config ({err}); {RETRAIN}") from None
    if not isinstance(config, dict):
        raise InputError(f"{path} is not a model config (a JSON object); {RETRAIN}")
    return config


def is_lean_compatible(config: dict) -> bool:
    """The lean engine implements GPT-2 exactly as configured by default (tanh GELU, no attention variants)."""
    return (
        config.get("model_type") == "gpt2"
        and config.get("activation_function", "gelu_new") in ("gelu_new", FUSED_GELU)
        and not config.get("scale_attn_by_inverse_layer_idx", False)
        and not config.get("reorder_and_upcast_attn", False)
        and config.get("tie_word_embeddings", True)
    )


# How a linear layer multiplies its input by a weight matrix: addmm over Hugging Face's Conv1D (in, out)
# layout, F.linear over (out, in), or oneDNN's matmul over (out, in) prepacked in its blocked layout (private
# ops, inductor's). Which is fastest depends on the device and the matrix's shape: on CPUs it is measured.
LAYOUTS = ("in_out", "out_in", "packed")


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear runs here in this dtype (bfloat16 needs AVX-512 or AVX-NE-CONVERT:
    an AVX2-only CPU refuses it)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype))
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 8, dtype=dtype), weight, None, "none", [], "")
    except RuntimeError:
        return False
    return True


class Projection:
    """x @ weight + bias, the (in, out) weight stored in one of LAYOUTS, then GPT-2's tanh GELU when `gelu`; the
    product is picked once, not per call. Prepacked, oneDNN applies the GELU to the product's float32 accumulator
    as it writes it out: one pass fewer over the MLP's widest activations (on an AMX CPU in bfloat16, 16 rows by
    512 x 2048 took 47 us against 73 for the product and F.gelu; in float32 about 10% less). The separate GELU
    rounds the product to the dtype first, so the two can differ in the last place."""

    def __init__(self, in_out: torch.Tensor, bias: torch.Tensor | None, layout: str, gelu: bool = False,
                 pad_rows: bool = False):
        self.layout, self.pad_rows = layout, pad_rows  # pad_rows: past PAD_ABOVE rows, to a multiple of ROW_BLOCK
        if layout == "packed":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(in_out.T.contiguous())
            attr, algorithm = ("gelu", "tanh") if gelu else ("none", "")
            self.multiply = lambda x: torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, attr, [], algorithm)
            return
        if layout == "in_out":
            self.weight = in_out
            product = (lambda x: x @ in_out) if bias is None else functools.partial(torch.addmm, bias, mat2=in_out)
        else:
            self.weight = in_out.T.contiguous()
            product = functools.partial(F.linear, weight=self.weight, bias=bias)
        self.multiply = (lambda x: F.gelu(product(x), approximate="tanh")) if gelu else product

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.pad_rows and rows > PAD_ABOVE and rows % ROW_BLOCK:
            return self.multiply(F.pad(x, (0, 0, 0, ROW_BLOCK - rows % ROW_BLOCK)))[:rows]
        return self.multiply(x)


@functools.cache
def fastest_layout(dtype: torch.dtype, device_type: str, in_features: int, out_features: int, gelu: bool = False) -> str:
    """The layout whose product of 1 and of 16 rows by a matrix of this shape (and its GELU, with `gelu`) takes
    least time here. On a GPU: F.linear in bfloat16, addmm in float32 (not measured). On CPUs it differs by kind
    and shape: oneDNN's prepacked product wins for wide matrices and loses for small ones, where its fixed cost per
    call dominates (docs/profiling.md); bfloat16 cannot be prepacked on a CPU with AVX2 alone. Every candidate is
    called once before the timing (its first call builds kernels), then the candidates take turns, so a drift of
    the machine's speed during the measurement weighs on all of them alike, and a candidate's first call cannot
    make it look slow."""
    if device_type != "cpu":
        return "out_in" if dtype == torch.bfloat16 else "in_out"
    weight = torch.randn(in_features, out_features, generator=torch.Generator().manual_seed(0)).to(dtype)
    bias = torch.zeros(out_features, dtype=dtype)
    cases = [(layout, Projection(weight, bias, layout, gelu), torch.ones(rows, in_features, dtype=dtype))
             for layout in LAYOUTS if layout != "packed" or onednn_packs(dtype) for rows in (1, 16)]
    samples = [[] for _ in cases]
    for _, projection, x in cases:
        projection(x)
    for _ in range(12):
        for (_, projection, x), timings in zip(cases, samples):
            start = time.perf_counter()
            projection(x)
            timings.append(time.perf_counter() - start)
    times = {}
    for (layout, _, _), timings in zip(cases, samples):
        times[layout] = times.get(layout, 0.0) + sorted(timings)[len(timings) // 2]
    return min(times, key=times.get)


class GPT2Engine(CachedLM):
    def __init__(self, config: dict, weights: dict[str, torch.Tensor], dtype: str = "float32", device: str = "cpu",
                 max_length: int | None = None, layout: str | None = None, cuda_graphs: bool = False,
                 shortlist: Shortlist | None = None, native_blocks: bool = False):
        """From a GPT-2 config and its weights as named in a Hugging Face checkpoint. `layout` (one of LAYOUTS)
        stores every matrix in that layout; by default each matrix gets the fastest measured for its shape. On a
        GPU with `cuda_graphs`, forwards replay CUDA graphs (decode.models.cuda_graphs). With a
        `shortlist`, the output layer computes the logits of its tokens only. With `native_blocks` (for a draft), a
        bfloat16 engine on a CPU with AVX-512 BF16 runs the blocks of a forward of a few rows (a step's tree, up to
        native.Blocks.ROWS) as one C++ call (decode/native's Blocks), which rounds differently from torch's."""
        if layout not in (None, *LAYOUTS):
            raise InputError(f"weight layout {layout!r}: choose one of {', '.join(LAYOUTS)} (or none: measured)")
        self.shape = s = GPT2Shape.from_config(config)
        self.device, self.dtype = torch.device(device), DTYPES[dtype]
        weights = {k.removeprefix("transformer."): v.to(self.device, self.dtype) for k, v in weights.items()}
        self.on_gpu = self.device.type == "cuda"

        pad_rows = self.device.type == "cpu" and self.dtype == torch.bfloat16

        def projection(in_out: torch.Tensor, bias: torch.Tensor | None, gelu: bool = False) -> Projection:
            return Projection(in_out, bias, layout or fastest_layout(self.dtype, self.device.type, *in_out.shape, gelu),
                              gelu, pad_rows)

        self.wte, self.wpe = weights["wte.weight"], weights["wpe.weight"]
        self.layers = []
        for i in range(s.n_layer):
            layer = {k[len(f"h.{i}.") :]: v for k, v in weights.items() if k.startswith(f"h.{i}.")}
            for name in LINEAR_LAYERS:
                layer[name] = projection(layer.pop(f"{name}.weight"), layer.pop(f"{name}.bias"), name == "mlp.c_fc")
            self.layers.append(layer)
        self.ln_f = (weights["ln_f.weight"], weights["ln_f.bias"])
        self.shortlist = shortlist
        output = self.wte if shortlist is None else self.wte[shortlist.tokens_on(self.device)]
        self.head = projection(output.T, None)  # the output projection, tied to wte
        self.layouts = {name: self.layers[0][name].layout for name in LINEAR_LAYERS} | {"head": self.head.layout}
        self.head_dim = s.n_embd // s.n_head
        self.max_length = max_length or s.n_positions  # positions: the context
        self.capacity = self.max_length + SPECULATIVE_SLOTS  # slots: a tree's nodes share positions
        # keys and values in one tensor (keys at [0], values at [1]): one copy writes or moves both
        self.kv_cache = torch.zeros((2, s.n_layer, s.n_head, self.capacity, self.head_dim), device=self.device,
                                    dtype=self.dtype)
        self.layer_caches = self.kv_cache.unbind(1)  # views, one per layer: indexing them parses one index fewer
        self.length = 0  # committed positions
        self.pending = 0  # speculative positions after them
        self.mask_values = [torch.tensor(v, dtype=self.dtype, device=self.device) for v in (0.0, float("-inf"))]
        self.graphs = CUDAGraphs(self) if cuda_graphs and self.on_gpu else None
        fits = native_blocks and native.Blocks.fit(s.n_embd, self.dtype, self.device)
        self.blocks = native.Blocks(s, weights, self.kv_cache, output) if fits else None
        # a commit's moves in C++ on a CPU: right after a forward, the cpu preset's oracle's torch copies (move_slots)
        # took 60-90 us a commit of 4 moved slots, the C++ 20-40 (its 96 planes' lines are out of the caches by then)
        self.move_in_cpp = native.slot_mover(self.kv_cache)

    @classmethod
    def load(cls, model_dir, dtype: str = "float32", device: str = "cpu", max_length: int | None = None,
             layout: str | None = None, cuda_graphs: bool = False, shortlist: Shortlist | None = None,
             native_blocks: bool = False) -> "GPT2Engine":
        """From a save_pretrained directory (safetensors)."""
        config = read_config(model_dir)
        if not is_lean_compatible(config):
            raise InputError(
                f"{model_dir} holds a {config.get('model_type')!r} model the lean GPT-2 engine does not implement; "
                f"use the transformers backend (--backend hf)"
            )
        return cls(config, load_safetensors(model_dir), dtype, device, max_length, layout, cuda_graphs, shortlist,
                   native_blocks)

    @property
    def vocab_size(self) -> int:
        return self.shape.vocab_size

    @torch.inference_mode()
    def forward(self, token_ids: Ids, position_ids: Ids, mask: torch.Tensor | None,
                last: int | None = None) -> torch.Tensor:
        q = len(token_ids)
        start = self.length + self.pending
        end = start + q
        if end > self.capacity:
            raise InputError(f"{q} new nodes after {start} cached slots overflow the cache of {self.capacity} slots; "
                             f"draft smaller trees (--budget, --widths)")
        if mask is not None and q == 1 and self.pending == 0:  # a lone node sees everything: no mask is faster
            mask = None
        elif mask is None and q > 1:  # a chain: the new nodes see the pending slots and their predecessors
            mask = torch.ones(q, self.pending + q, dtype=torch.bool, device=self.device).tril(self.pending)
        graph = self.graphs.get(q, start, end) if self.graphs is not None else None
        if graph is not None:
            logits = graph(as_tensor(token_ids, self.device), as_tensor(position_ids, self.device), mask, start, end)
            logits = logits if last is None else logits[q - last :]
        else:
            logits = self.logits(token_ids, position_ids, mask, slice(start, end), end, last)
        self.pending += q
        return logits

    def logits(self, token_ids: Ids, position_ids: Ids, mask: torch.Tensor | None,
               slots: slice | torch.Tensor, end: int, last: int | None = None) -> torch.Tensor:
        """Float32 logits of new nodes (of the `last` of them, with `last`) that write their keys/values into cache
        `slots` and attend to slots 0..end: all of them, or with a (q, k) boolean `mask`, the last k where it is
        true and every one before them."""
        if self.blocks is not None and isinstance(slots, slice) and len(token_ids) <= native.Blocks.ROWS:
            return self.blocks(token_ids, position_ids, mask, slots.start, end, last)
        token_ids, position_ids = as_tensor(token_ids, self.device), as_tensor(position_ids, self.device)
        # F.embedding (an index_select) took 7 us for 16 rows where indexing the matrices took 17 (AMX CPU, bfloat16)
        x = F.embedding(token_ids, self.wte) + F.embedding(position_ids, self.wpe)
        if mask is not None:  # SDPA makes a boolean mask additive in every layer (5-7 us each on a CPU): once here,
            # over the slots the mask covers, then padded with the committed slots' zeros (one op, not a copy into ones)
            mask = F.pad(torch.where(mask, *self.mask_values), (end - mask.shape[1], 0))
        if self.on_gpu:
            with sdpa_kernel(ATTENTION_WITHOUT_CUDNN):
                x = self.layers_forward(x, mask, slots, end)
        else:
            x = self.layers_forward(x, mask, slots, end)
        if last is not None:
            x = x[x.shape[0] - last :]
        x = F.layer_norm(x, (self.shape.n_embd,), *self.ln_f, self.shape.layer_norm_epsilon)
        return self.head(x).float()

    def layers_forward(self, x: torch.Tensor, mask: torch.Tensor | None, slots: slice | torch.Tensor, end: int
                       ) -> torch.Tensor:
        """The transformer blocks over q new nodes, writing their keys/values into cache `slots`."""
        s, q = self.shape, x.shape[0]
        for layer, cache in zip(self.layers, self.layer_caches):
            h = F.layer_norm(x, (s.n_embd,), layer["ln_1.weight"], layer["ln_1.bias"], s.layer_norm_epsilon)
            qkv = layer["attn.c_attn"](h)
            qkv = qkv.view(q, 3, s.n_head, self.head_dim).permute(1, 2, 0, 3)
            cache[:, :, slots] = qkv[1:]
            keys, values = cache[:, None, :, :end]
            # a batch dimension and a contiguous query let torch pick its fused attention kernel
            att = F.scaled_dot_product_attention(qkv[0].contiguous()[None], keys, values, attn_mask=mask)[0]
            x = x + layer["attn.c_proj"](att.transpose(0, 1).reshape(q, s.n_embd))
            h = F.layer_norm(x, (s.n_embd,), layer["ln_2.weight"], layer["ln_2.bias"], s.layer_norm_epsilon)
            x = x + layer["mlp.c_proj"](layer["mlp.c_fc"](h))  # c_fc applies the GELU
        return x

    @torch.inference_mode()
    def commit(self, keep: list[int]) -> None:
        if self.move_in_cpp is not None:
            self.move_in_cpp(self.length, keep)
        else:
            self.move_slots(keep)
        self.length += len(keep)
        self.pending = 0

    def move_slots(self, keep: list[int]) -> None:
        """Pending slot keep[i] to slot length + i, by torch copies. Slots already in place stay: drafters put a
        tree's likeliest path first (Tree.subtree), so an accepted path is often all in place, and the rest of it,
        numbered depth first, holds runs of consecutive slots. Each run is copied as one block, split where it would
        overlap its destination. Right after a forward, copying slot by slot is faster than one index_select of the
        slots (95-105 against 145-185 us a commit of the cpu preset's oracle), and blocks cut the copies further."""
        n = len(keep)
        start = next((i for i, slot in enumerate(keep) if slot != i), n)
        while start < n:
            end = start + 1
            while end < n and keep[end] == keep[end - 1] + 1 and end < keep[start]:
                end += 1
            self.kv_cache.narrow(3, self.length + start, end - start).copy_(
                self.kv_cache.narrow(3, self.length + keep[start], end - start))
            start = end
