"""What the lean engines share: a preallocated KV cache of slots, a forward of new nodes over any tree, run by the
model's runtime (the C++ forward of a few rows where it has one, CUDA graphs where it replays them, torch's
operations otherwise), and a commit that keeps the accepted path.

The cache holds `length` committed positions followed by `pending` speculative ones. `forward` scores new nodes (any
tree: the caller gives positions and a mask over the pending slots plus the new nodes; committed positions are always
visible), appends their keys/values to the speculative region, and returns their logits. `commit` keeps an ordered
subset of the speculative slots (the accepted path) and drops the rest. Each architecture (decode.models.engine's
GPT-2, decode.models.llama's Llama family) gives its weights, torch's forward (`torch_logits`) and which configs
it runs (`why_not`).
"""
import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F

from decode.errors import InputError
from decode.models.cached_lm import CachedLM, Call, ChainCall
from decode.models.kv_slots import KVSlots
from decode.models.model_config import read_config
from decode.models.pretrained import load_safetensors
from decode.models.quantized import Format, QuantizedMatrix, checkpoint_blocks, split_checkpoint
from decode.models.runtime import Runtime
from decode.sampling import Sparse
from decode.shortlist import Shortlist
from decode.tensors import Ids, as_tensor
from decode.tree import rows_mask

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SPECULATIVE_SLOTS = 2048  # cache slots beyond the context for the nodes of a speculative tree


def on_device(checkpoint: dict[str, torch.Tensor], take: Callable[[str], torch.Tensor], prefix: str,
              device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors on `device` in `dtype`, named without `prefix`, each taken out with `take` (a
    checkpoint read for one engine alone gives them up, so that it holds no matrix the C++ packed)."""
    return {name.removeprefix(prefix): take(name).to(device, dtype) for name in list(checkpoint)}


def torch_weights_on_first_use(made, reload: Callable[[], dict] | None, convert: Callable[[dict, Callable], dict],
         torch_weights: Callable[[dict], tuple]) -> Callable[[], tuple]:
    """What makes torch's weights for an engine: those `made` already, else `torch_weights` of the checkpoint
    `reload()` reads again (the C++ forward took the matrices of the first), converted by `convert`."""
    def make() -> tuple:
        if made is not None:
            return made
        assert reload is not None  # the C++ took the matrices out only where a reload gives them again
        checkpoint = reload()
        return torch_weights(convert(checkpoint, checkpoint.pop))

    return make


def chunks(q: int, size: int, last: int) -> list[tuple[int, int, int]]:
    """The C++ calls q rows are read in, `size` rows each, as (first row, end, logits asked of it) when the last
    `last` rows' logits are asked."""
    ends = [(a, min(a + size, q)) for a in range(0, q, size)]
    return [(a, b, max(0, min(b - a, last - (q - b)))) for a, b in ends]


class LeanEngine(CachedLM):
    def __init__(self, shape, torch_weights: Callable[[], tuple], layouts: dict[str, str], kv: KVSlots,
                 max_length: int, runtime: Runtime, shortlist: Shortlist | None = None):
        """A model of this `shape` over a cache of `kv` slots, run by its `runtime` (decode.models.runtime) on its
        device in its dtype. `torch_weights()` makes the weights torch's forward reads (`layers`, the output projection
        `head`, over the `shortlist`'s tokens only when there is one, and the token `embedding`), stored in
        `layouts`, on that forward's first use: an engine whose forwards all run in C++ never holds them."""
        self.shape = shape
        self.make_torch_weights, self.layouts = torch_weights, layouts
        self.made_torch_weights: tuple | None = None
        self.kv, self.max_length, self.shortlist, self.runtime = kv, max_length, shortlist, runtime
        self.device, self.dtype, self.vocab_size = runtime.device, runtime.dtype, shape.vocab_size
        self.seen, self.unseen = (torch.tensor(v, dtype=self.dtype, device=self.device) for v in (0.0, float("-inf")))
        self.graphs = runtime.graphs(self)

    @classmethod
    def load(cls, model_dir, dtype: str = "float32", device: str = "cpu", max_length: int | None = None,
             layout: str | None = None, cuda_graphs: bool = False, shortlist: Shortlist | None = None,
             native_blocks: bool = False, calibrate: bool = False, tokens: int | None = None,
             quantization: Format | None = None, compile_layers: bool = False) -> "LeanEngine":
        """From a save_pretrained directory (safetensors); its output over the first `tokens` rows only, where
        given (a config whose vocabulary pads the tokenizer's: see loading.token_rows); its matrices in
        `quantization`'s blocks, quantized as it loads, where given (a quantized checkpoint's are in its own); torch's
        forward computes its layers through torch.compile with `compile_layers`. The rest as `build`."""
        config = read_config(model_dir, tokens)
        why = cls.why_not(config)
        if why:
            raise InputError(f"{model_dir} cannot run on the lean engine: {why}; use the transformers backend (--backend hf)")

        def build(weights: dict, reload: Callable[[], dict], quantized: dict | None = None) -> "LeanEngine":
            return cls.build(config, weights, dtype, device, max_length, layout, cuda_graphs, shortlist, native_blocks,
                             calibrate, reload=reload, quantized=quantized, compile_layers=compile_layers)

        blocks = checkpoint_blocks(model_dir, config, quantization)
        if blocks is None:
            return build(load_safetensors(model_dir), lambda: load_safetensors(model_dir))
        fmt, tensors = blocks
        dense, quantized = split_checkpoint(tensors(), fmt, model_dir)
        missing = sorted(set(cls.quantized_names(config)) - set(quantized))
        if missing:
            raise InputError(f"{model_dir} is a {fmt.name} checkpoint without quantized {', '.join(missing[:3])}"
                             f"{' ...' if len(missing) > 3 else ''}; quantize the 16-bit model again (python -m decode.quantize)")
        return build(dense, lambda: cls.dequantized_checkpoint(tensors(), fmt, model_dir), quantized)

    @classmethod
    def build(cls, config: dict, weights: dict[str, torch.Tensor], dtype: str = "float32", device: str = "cpu",
              max_length: int | None = None, layout: str | None = None, cuda_graphs: bool = False,
              shortlist: Shortlist | None = None, native_blocks: bool = False, calibrate: bool = False,
              reload: Callable[[], dict[str, torch.Tensor]] | None = None,
              quantized: dict[str, QuantizedMatrix] | None = None, compile_layers: bool = False) -> "LeanEngine":
        """A model of this config from its weights as a Hugging Face checkpoint names them (the quantized ones in
        `quantized`), run by the device's runtime."""
        raise NotImplementedError

    @staticmethod
    def why_not(config: dict) -> str | None:
        """Why this engine cannot run a model of this config (None: it can): the feature named as config.json names it."""
        raise NotImplementedError

    @staticmethod
    def quantized_names(config: dict) -> list[str]:
        """The matrices a quantized checkpoint of this config holds in blocks at the least."""
        raise NotImplementedError

    @staticmethod
    def dequantized_checkpoint(tensors: dict[str, torch.Tensor], fmt: Format, where) -> dict[str, torch.Tensor]:
        """A quantized checkpoint's tensors (read from `where`), every matrix dequantized to float32."""
        raise NotImplementedError

    def torch_weights(self) -> tuple:
        if self.made_torch_weights is None:
            self.made_torch_weights = self.make_torch_weights()
        return self.made_torch_weights

    layers = property(lambda self: self.torch_weights()[0])
    head = property(lambda self: self.torch_weights()[1])
    embedding = property(lambda self: self.torch_weights()[2])

    # the cache's state, as CachedLM's callers read and write it
    length = property(lambda self: self.kv.length, lambda self, n: setattr(self.kv, "length", n))
    pending = property(lambda self: self.kv.pending, lambda self, n: setattr(self.kv, "pending", n))
    capacity = property(lambda self: self.kv.capacity)
    kv_cache = property(lambda self: self.kv.cache)

    def fork(self, slots: int | None = None) -> "LeanEngine":
        fork = copy.copy(self)
        fork.kv = self.kv.fresh(self.runtime.mover, None if slots is None else self.max_length + slots)
        fork.make_torch_weights = self.torch_weights  # torch's weights, where a forward needs them, made once for all
        fork.graphs = self.runtime.graphs(fork)
        return fork

    def cache_bytes(self) -> int:
        return self.kv.cache.nbytes

    def speculative_slots(self) -> int:
        return self.kv.capacity - self.max_length

    def visible(self, q: int, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The mask q new nodes run under, given `forward`'s."""
        pending = self.kv.pending
        if mask is not None and q == 1 and pending == 0:  # a lone node sees everything: no mask is faster
            return None
        if mask is None and q > 1:  # a chain: the new nodes see the pending slots and their predecessors
            # remembered as a tree's mask is: a draft step's first call feeds a chain of one shape after another
            return rows_mask(tuple((2 << slot) - 1 for slot in range(pending, pending + q)), pending + q, self.device)
        return mask

    @property
    def runs_together(self) -> bool:
        return self.runtime.blocks is not None and self.graphs is None

    def pieces(self, call: Call) -> list[Call]:
        q = len(call.token_ids)
        if not (call.extend and q > self.runtime.rows and self.runtime.chunks and self.runs_together):
            return [call]
        return [Call(call.token_ids[a:b], last=asked, extend=True)
                for a, b, asked in chunks(q, self.runtime.rows, q if call.last is None else call.last)]

    def batches(self, call: Call) -> bool:
        """Whether this call's forward runs as one C++ call, and so as a part of one over several sequences' rows
        (`part`)."""
        return self.runs_together and len(call.token_ids) <= self.runtime.rows

    def part(self, call: Call) -> tuple:
        """The call as a part of native.Blocks.batch (its slots checked to fit): its logits from there are those
        `run` gives, once `settle` has kept its nodes as `run` would."""
        q = len(call.token_ids)
        start, _ = self.kv.reserve(q)
        positions = list(range(start, start + q)) if call.extend else call.position_ids
        return (self.kv.field, call.token_ids, positions, self.visible(q, None if call.extend else call.mask), start,
                call.last)

    def settle(self, call: Call) -> None:
        """After its part ran: its nodes pending, or an extend's committed."""
        self.kv.pending += len(call.token_ids)
        if call.extend:
            self.kv.length += self.kv.pending
            self.kv.pending = 0

    def forward(self, token_ids: Ids, position_ids: Ids, mask: torch.Tensor | None,
                last: int | None = None) -> torch.Tensor:
        q, kv = len(token_ids), self.kv
        start, end = kv.reserve(q)
        mask = self.visible(q, mask)
        graph = self.graphs.get(q, start, end) if self.graphs is not None else None
        if graph is not None:
            with torch.inference_mode():
                logits = graph(as_tensor(token_ids, self.device), as_tensor(position_ids, self.device), mask, start, end)
            logits = logits if last is None else logits[q - last :]
        else:
            logits = self.logits(token_ids, position_ids, mask, slice(start, end), end, last)
        kv.pending += q
        return logits

    def chains(self, rows: int, sampling) -> bool:
        """A chain's forwards run as one C++ call where each of them would run in C++ (the first of `rows` rows), greedy
        or under a top-k setting."""
        return rows <= self.runtime.rows and (sampling.greedy or sampling.sparse)

    def chain(self, token_ids: Ids, position_ids: Ids, steps: int, sampling, uniforms: list[float]
              ) -> tuple[list[int], list[Sparse] | None]:
        call = ChainCall(self, token_ids, position_ids, steps, sampling, uniforms)
        blocks = self.runtime.blocks
        assert blocks is not None  # `chains` says so only where the runtime has a C++ forward
        [chosen] = blocks.chains([self.chain_part(call)], self.shortlist)
        self.chain_settle(call)
        return chosen

    def chain_part(self, call: ChainCall) -> tuple:
        """The chain as a part of native.Blocks.chains (its slots checked to fit): what it gives there is what
        `chain` gives, once `chain_settle` has kept its nodes pending as `chain` would."""
        start, _ = self.kv.reserve(len(call.token_ids) + call.steps - 1)  # the last token chosen is not fed
        return self.kv.field, call.token_ids, call.position_ids, start, call.steps, call.sampling, call.uniforms

    def chain_settle(self, call: ChainCall) -> None:
        self.kv.pending += len(call.token_ids) + call.steps - 1

    def logits(self, token_ids: Ids, position_ids: Ids, mask: torch.Tensor | None,
               slots: slice | torch.Tensor, end: int, last: int | None = None) -> torch.Tensor:
        """Float32 logits of new nodes (of the `last` of them, with `last`) that write their keys/values into cache
        `slots` and attend to slots 0..end: all of them, or with a (q, k) boolean `mask`, the last k where it is
        true and every one before them."""
        blocks = self.runtime.blocks  # run up to `rows` rows (none without a C++ forward)
        if len(token_ids) <= self.runtime.rows and isinstance(slots, slice) and blocks is not None:
            return blocks(self.kv.field, token_ids, position_ids, mask, slots.start, last)
        if self.runtime.chunks and isinstance(slots, slice) and mask is not None:
            return self.chunked_logits(token_ids, position_ids, mask, slots.start, last)
        if blocks is not None and isinstance(slots, slice) and mask is not None and last and last <= self.runtime.rows:
            return self.asked_in_cpp(token_ids, position_ids, mask, slots, end, last)
        with torch.inference_mode():  # torch's forward only: entering it costs, and a C++ forward needs none of it
            return self.torch_logits(token_ids, position_ids, mask, slots, end, last)

    def asked_in_cpp(self, token_ids: Ids, position_ids: Ids, mask: torch.Tensor, slots: slice, end: int,
                     last: int) -> torch.Tensor:
        """`logits` of more rows than one C++ call takes, the last `last` of them asked (a prompt's last): the rows
        before them through torch, which reads many rows faster here, then the asked rows as one C++ call. An asked row
        then has the bits the C++ call gives it wherever it is scored: a speculative method scores a prompt's last token
        as its first tree's root, after the rest of the prompt read the same way."""
        head, pending = len(token_ids) - last, mask.shape[1] - len(token_ids)
        with torch.inference_mode():
            self.torch_logits(token_ids[:head], position_ids[:head], mask[:head, : pending + head],
                              slice(slots.start, slots.start + head), end - last, 0)
        blocks = self.runtime.blocks
        assert blocks is not None  # `logits` asks only with a C++ forward
        return blocks(self.kv.field, token_ids[head:], position_ids[head:], mask[head:], slots.start + head, last)

    def chunked_logits(self, token_ids: Ids, position_ids: Ids, mask: torch.Tensor, start: int,
                       last: int | None = None) -> torch.Tensor:
        """`logits` of more rows than one C++ call takes (a prompt), as C++ calls of the runtime's `rows` rows each, where the
        C++ call ran faster than torch at every row count measured: each call's rows see the slots before them as
        `mask` says (its columns: the pending slots, then the new rows), those of the calls before included. A row's
        logits do not depend on the other rows of its call (forward.cpp), so they are those of one long call."""
        q, blocks = len(token_ids), self.runtime.blocks
        assert blocks is not None  # the runtime `chunks` only with a C++ forward
        pending = mask.shape[1] - q
        return torch.cat([blocks(self.kv.field, token_ids[a:b], position_ids[a:b], mask[a:b, : pending + b], start + a,
                                 asked) for a, b, asked in chunks(q, self.runtime.rows, q if last is None else last)])

    def additive(self, mask: torch.Tensor | None, end: int) -> torch.Tensor | None:
        """A (q, k) boolean mask over the last k of slots 0..end as torch's attention adds it: SDPA would make a
        boolean mask additive in every layer, so it is made once, over the slots the mask covers, then padded with the
        committed slots' zeros (one op, not a copy into ones)."""
        return None if mask is None else F.pad(torch.where(mask, self.seen, self.unseen), (end - mask.shape[1], 0))

    def torch_logits(self, token_ids: Ids, position_ids: Ids, mask: torch.Tensor | None,
                     slots: slice | torch.Tensor, end: int, last: int | None = None) -> torch.Tensor:
        """`logits` through torch's operations."""
        raise NotImplementedError

    def commit(self, keep: list[int]) -> None:
        self.kv.commit(keep)
