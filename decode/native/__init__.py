"""C++ for the work around a model's forwards and for the forwards themselves: a decoding step's loops over trees
and logits (decode/native/step.cpp, which decode.kernels.NativeKernels calls: the trigram's tree below a new context,
the staged drafter's greedy selection, sample-match and multi-draft rejection, each row's best tokens, top-k
distributions and draws, the continuations a context repeats) and a commit's moves in a CPU cache; and a model's
forward over a few rows (decode/native/forward.cpp, `Blocks`), built for AVX-512 (AVX-512 BF16 for a bfloat16 model)
or for AVX2 with FMA, whichever this CPU runs.

torch's extension builder compiles the file on first use (a few seconds; cached under ~/.cache/torch_extensions in a
directory named by the hash of the source and its headers, so checkouts of different versions neither rebuild in
turn nor replace a module another process has loaded). Where it cannot (no C++ compiler or ninja), decoding runs
the portable loops (decode.kernels.PortableKernels), which give the same trees and paths.
STAGED_SPECULATIVE_NATIVE=0 turns the C++ off.
"""
import functools
import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Protocol

import torch

from decode.errors import first_line
from decode.machine import cpu_flags
from decode.sampling import Sparse
from decode.tensors import Ids, as_list

log = logging.getLogger("decode.native")  # notes a user sees on stderr without any logging set up (warnings)

SOURCE = Path(__file__).with_name("step.cpp")
FORWARD_SOURCE = Path(__file__).with_name("forward.cpp")
FORWARD_SOURCES = (FORWARD_SOURCE, *sorted(FORWARD_SOURCE.parent.glob("*.h")))  # what the forward's build reads
# The instruction sets forward.cpp is built for, each with its compiler defines and the CPU flags (as /proc/cpuinfo
# names them) it needs; a CPU runs the first its flags allow, bfloat16 AVX-512 only with AVX-512 BF16
FORWARD_BUILDS = {"AVX-512": (["-DFORWARD_AVX512"], {"avx512f", "avx512bw", "avx512vl"}),
                  "AVX2": ([], {"avx2", "fma"})}
# OpenMP: at::parallel_for shares the products among torch's own threads (on its libgomp, loaded already) only in
# code compiled with it
FLAGS = ["-O3", "-fopenmp"]


STALE_LOCK_SECONDS = 600  # a build takes seconds to a minute: a lock this old was left by a process killed mid-build


def build(source: Path, defines: tuple[str, ...] = ()):
    """A C++ source compiled as a Python module (cached, named by the hash of the source, the headers beside it, the
    flags and the source's folder: torch's builder rebuilds a name whose sources' paths change, so two clones on one
    machine would otherwise rebuild each other's module at every start)."""
    from torch.utils import cpp_extension

    flags = [*FLAGS, *defines]
    code = b"".join(path.read_bytes() for path in (source, *sorted(source.parent.glob("*.h"))))
    identity = code + " ".join([*flags, str(source.resolve().parent)]).encode()
    name = f"{source.stem}_{hashlib.sha256(identity).hexdigest()[:12]}"
    remove_stale_locks(Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()), name)
    return cpp_extension.load(name, [str(source)], extra_cflags=flags, extra_ldflags=["-fopenmp"])


def remove_stale_locks(root: Path, name: str) -> None:
    """Remove the build lock of module `name` under torch's extension root (TORCH_EXTENSIONS_DIR, or the default
    root's folder for this Python and accelerator) where it is older than a build takes: torch's builder waits on a
    lock for ever, and a process killed while it compiled leaves one behind."""
    for lock in (root / name / "lock", *root.glob(f"*/{name}/lock")):
        try:
            age = time.time() - lock.stat().st_mtime
        except OSError:  # no lock, or another process removed it meanwhile
            continue
        if age > STALE_LOCK_SECONDS:
            log.warning("note: removing %s, left %.0f minutes ago by a build that did not finish", lock, age / 60)
            lock.unlink(missing_ok=True)


@functools.cache
def module():
    """The compiled module, or None (said once on stderr, with why) where it cannot be built."""
    if os.environ.get("STAGED_SPECULATIVE_NATIVE", "1") == "0":
        return None
    try:
        return distributions_as_sparse(build(SOURCE))
    except Exception as err:  # no compiler, no ninja, a failed build: decoding goes on in Python
        log.warning("note: the decoding step's C++ loops could not be built (%s); decoding uses their portable code, "
                    "which gives the same output a little slower (STAGED_SPECULATIVE_NATIVE=0 silences this)", first_line(err))
        return None


def forward_build(dtype: torch.dtype) -> str | None:
    """Which build of forward.cpp runs a model in `dtype` on this CPU (a key of FORWARD_BUILDS), or None."""
    flags = cpu_flags()
    for name, (_, needs) in FORWARD_BUILDS.items():
        if needs <= flags and (name != "AVX-512" or dtype != torch.bfloat16 or "avx512_bf16" in flags):
            return name
    return None


@functools.cache
def forward_module(dtype: torch.dtype):
    """The compiled forward of decode/native/forward.cpp that runs a model in `dtype` here, or None: no C++ loops
    (module() said why), a CPU with neither AVX2 nor AVX-512, or a failed build (each said once)."""
    if module() is None:
        return None
    name = forward_build(dtype)
    if name is None:
        note_once("this CPU has neither AVX2 with FMA nor AVX-512: the models' forwards run in torch, whose forward of a "
                  "few rows costs several times the C++ call's")
        return None
    try:
        compiled = _forward_build(name)
    except Exception as err:
        note_once(f"the C++ forward ({name}) could not be built ({first_line(err)}); the models' forwards run in torch, "
                  f"whose forward of a few rows costs several times the C++ call's")
        return None
    return compiled if compiled.supported(dtype.itemsize) else None


@functools.cache
def _forward_build(name: str):
    return distributions_as_sparse(build(FORWARD_SOURCE, tuple(FORWARD_BUILDS[name][0])))


def distributions_as_sparse(compiled):
    """A built module, told to return its distributions as sampling.Sparse."""
    compiled.set_distribution_type(Sparse)
    return compiled


@functools.cache
def note_once(text: str) -> None:
    log.warning("note: %s", text)


class SlotMover:
    """A commit's moves in C++ over a contiguous (..., capacity, head_dim) CPU cache, as a function of (length, keep)
    under which, in each plane, slot length + i takes slot length + keep[i]. It holds the cache, whose address and
    shape it reads once: right after a forward, each torch call to read them again pays for evicted caches."""

    def __init__(self, kv_cache: torch.Tensor):
        if not (kv_cache.is_cpu and kv_cache.is_contiguous()):
            raise ValueError("the C++ moves take a contiguous cache in CPU memory")
        self.cache, self.commit_slots = kv_cache, module().commit_slots
        self.capacity, head_dim = kv_cache.shape[-2:]
        self.address, self.planes = kv_cache.data_ptr(), kv_cache.numel() // (self.capacity * head_dim)
        self.slot_bytes = head_dim * kv_cache.element_size()

    def __call__(self, length: int, keep: list[int]) -> None:
        self.commit_slots(cache=self.address, planes=self.planes, capacity=self.capacity, slot_bytes=self.slot_bytes,
                          length=length, keep=keep)


def pack_for_products(in_out: torch.Tensor) -> torch.Tensor:
    """An (in, out) weight as native/forward.cpp's products read it: blocks of 16 output columns (the last padded with
    zeros); in each, bfloat16: the two weights of every pair of input rows side by side (the operand layout of
    AVX-512 BF16's dot product; the AVX2 build widens each half to float32); float32: the weights of every input row."""
    padding = -in_out.shape[1] % 16
    # padded only where it must be: a transient copy of every matrix stays in the allocator's pools as it is freed
    in_out = (torch.nn.functional.pad(in_out, (0, padding)) if padding else in_out).contiguous()
    rows, columns = in_out.shape
    per_step = 2 if in_out.dtype == torch.bfloat16 else 1  # input rows a 64-byte step covers
    return in_out.view(rows // per_step, per_step, columns // 16, 16).permute(2, 0, 3, 1).contiguous()


def pack_quantized(matrix: "QuantizedWeight") -> torch.Tensor:
    """An (out, in) matrix's blocks as native/quantized.h's products read them: output columns in blocks of 16 (the
    last padded with zero scales and values), and in each, for every 32 inputs, the 16 columns' float16 scales (32
    bytes), then lines of 64 bytes, byte 4j + t of line m holding column j's value for input 4m + t: Q8_0, 8 lines of
    int8; Q4_0, 4 lines whose low nibbles are inputs 4m + t and high nibbles inputs 16 + 4m + t, the pairs of each
    column's llama.cpp block."""
    out, in_features = matrix.shape
    quants = matrix.quants.view(torch.uint8)
    scales = matrix.scales.view(torch.uint8).reshape(out, -1, 2)
    groups, columns, whole = in_features // 32, -(-out // 16), out // 16  # whole: the blocks without padding
    # copied straight into place: a matrix-sized temporary a matrix, freed between the packed matrices a load keeps,
    # would leave the allocator's heap holding its pages
    packed = torch.empty(columns, groups, 32 + 16 * quants.shape[1] // groups, dtype=torch.uint8)
    fill_blocks(packed[:whole], quants[: 16 * whole], scales[: 16 * whole])
    if whole < columns:  # the last block's columns past `out`: zero scales and values
        padding = 16 * columns - out
        fill_blocks(packed[whole:], torch.nn.functional.pad(quants[16 * whole:], (0, 0, 0, padding)),
                    torch.nn.functional.pad(scales[16 * whole:], (0, 0, 0, 0, 0, padding)))
    return packed


def fill_blocks(packed: torch.Tensor, quants: torch.Tensor, scales: torch.Tensor) -> None:
    """pack_quantized's blocks of 16 columns, written into `packed` from their rows' bytes (a multiple of 16 rows)."""
    columns, groups = packed.shape[:2]
    packed[..., :32].unflatten(-1, (16, 2)).copy_(scales.reshape(columns, 16, groups, 2).permute(0, 2, 1, 3))
    line_count = (packed.shape[2] - 32) // 64
    lines = quants.reshape(columns, 16, groups, line_count, 4).permute(0, 2, 3, 1, 4)  # (block, group, line, column, input)
    packed[..., 32:].unflatten(-1, (line_count, 16, 4)).copy_(lines)


class QuantizedWeight(Protocol):
    """An (out, in) matrix in a block format, as decode.models.quantized.QuantizedMatrix holds it: `quants` (int8 or
    packed 4-bit values), float16 `scales` (out, in / 32), and its format's `code` as forward.cpp numbers it."""

    quants: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]: ...

    @property
    def code(self) -> int: ...


def packed(weight: "torch.Tensor | QuantizedWeight") -> torch.Tensor:
    """A linear layer's weight as the products read it: an (in, out) tensor in the model's dtype, or a quantized
    (out, in) matrix."""
    return pack_for_products(weight) if isinstance(weight, torch.Tensor) else pack_quantized(weight)


def tensor_field(tensor: torch.Tensor) -> tuple[int, int, int]:
    """A tensor as forward.cpp reads it: (address, elements, element_bytes)."""
    return tensor.data_ptr(), tensor.numel(), tensor.element_size()


class Blocks:
    """A bfloat16 or float32 GPT-2's or Llama-family model's forward over a few new rows as one C++ call
    (decode/native/forward.cpp): embeddings, blocks, final norm and output layer. Its keys and values go to the cache
    each call names (an engine's) as torch's would; one call may run several sequences' rows, each over its own cache
    (`batch`)."""

    MATRICES = ("qkv", "attn_out", "mlp_in", "mlp_out")  # a block's, as forward.cpp names them
    # The most rows a forward takes it for, until decode.models.native_rows measures how many pay on this machine
    ROWS = 64

    @staticmethod
    def fit(n_embd: int, dtype: torch.dtype, device: torch.device, quantized: bool = False) -> bool:
        """Whether these blocks can run a model of this width, dtype and device here (its matrices in Q8_0 or Q4_0
        blocks with `quantized`: said once where this CPU lacks the instructions)."""
        fits = (device.type == "cpu" and dtype in (torch.bfloat16, torch.float32) and n_embd % 16 == 0
                and forward_module(dtype) is not None)
        if fits and quantized and not forward_module(dtype).quantized_supported():
            note_once("this CPU lacks the quantized products' instructions (AVX-512 VNNI, or AVX2 and F16C): a quantized "
                      "model's forwards run in torch over its dequantized weights, several times slower")
            return False
        return fits

    def __init__(self, shape: dict, tensors: dict, output: "torch.Tensor | QuantizedWeight", dtype: torch.dtype,
                 consume: bool = False):
        """A model of `dtype` (its activations and cache). `shape`: forward.cpp's model() ints and epsilon
        (architecture, n_embd, heads, kv_heads, head_dim, intermediate, layers, epsilon); `tensors`: by its names (wte,
        or a quantized model's embeddings (QuantizedWeight), or neither where `output` is the whole vocabulary's
        embeddings, which the C++ then reads there; GPT-2's wpe and norm biases, the Llama family's rope.cos and
        rope.sin; norm_f.weight; per layer i h.{i}.norm_1.weight, h.{i}.norm_2.weight), and each block's four MATRICES
        as h.{i}.qkv and so on: (in, out) in the model's dtype or, in a quantized model, QuantizedWeight (out, in), each
        with its float bias (h.{i}.qkv.bias; zeros where absent); `output`: the output layer's (columns, n_embd)
        weight (the whole vocabulary's or a shortlist's rows), quantized in a quantized model. With `consume`, each
        matrix is taken out of `tensors` as it is packed, so that its memory goes as its packed copy comes."""
        take = tensors.pop if consume else tensors.__getitem__
        self.kept = {}  # every tensor the C++ reads, by the name model() knows it under (`spec`: as it reads them)
        self.forward = forward_module(dtype)
        for name in list(tensors):
            if name.rsplit(".", 1)[-1] in self.MATRICES:
                matrix = take(name)
                bias = tensors.get(f"{name}.bias")
                columns = matrix.shape[1] if isinstance(matrix, torch.Tensor) else matrix.shape[0]
                self.kept[f"{name}.packed"] = packed(matrix)
                self.kept[f"{name}.bias"] = torch.zeros(columns) if bias is None else bias.float().contiguous()
            elif name == "embeddings":
                self.kept["embeddings.packed"] = packed(tensors[name])
            elif name in ("wte", "wpe"):
                self.kept[name] = tensors[name].contiguous()
            elif not name.endswith(tuple(f"{m}.bias" for m in self.MATRICES)):  # norms, rotary tables
                self.kept[name] = tensors[name].float().contiguous()
        self.kept |= {"output.packed": packed(output.T if isinstance(output, torch.Tensor) else output),
                      "output.bias": torch.zeros(-(-output.shape[0] // 16) * 16)}
        fields = {name: tensor_field(tensor) for name, tensor in self.kept.items()}
        positions = self.kept["wpe"] if "wpe" in self.kept else self.kept["rope.cos"]
        self.spec = fields | shape | {
            "vocabulary": next((tensors[name].shape[0] for name in ("wte", "embeddings") if name in tensors), output.shape[0]),
            "positions": positions.shape[0], "logit_columns": output.shape[0], "element_bytes": dtype.itemsize,
            "epsilon": float(shape["epsilon"]), "format": 0 if isinstance(output, torch.Tensor) else output.code}
        self.model = self.forward.model(self.spec)
        self.columns = output.shape[0]
        self.tiles = True

    @property
    def can_tile(self) -> bool:
        """Whether this model's products can run on AMX's tiles here (a quantized model on a CPU with AMX-INT8; a
        bfloat16 model, every product's input a multiple of 32, on a CPU with AMX-BF16)."""
        return self.forward.tiles(model=self.model, on=None)

    @property
    def tiles(self) -> bool:
        """Whether the products (and a bfloat16 model's attention scores) run on AMX's tiles (where can_tile: until
        decode.models.native_rows measures which of the two runs faster here) or as vector dot products. Each gives a
        row the same logits whatever the forward's other rows; a bfloat16 model's two differ in rounding, a quantized
        model's sum in integers and agree bit for bit."""
        return self._tiles

    @tiles.setter
    def tiles(self, on: bool):
        self._tiles = bool(on) and self.can_tile
        self.forward.tiles(model=self.model, on=self._tiles)  # which the C++ takes only where the CPU has them

    def __call__(self, cache: tuple[int, int, int], token_ids: Ids, position_ids: Ids, mask: torch.Tensor | None,
                 start: int, last: int | None = None) -> torch.Tensor:
        """Float32 logits of new nodes in `cache`'s slots from `start` on (of the `last` of them, with `last`), as
        the engines' `logits` give them; `mask` as they take it, None for a chain. `cache`: an engine's (2, layers,
        kv_heads, capacity, head_dim) kv_cache in the model's dtype, as `tensor_field` gives it (KVSlots.field)."""
        ids, positions = as_list(token_ids), as_list(position_ids)
        last = len(ids) if last is None else last
        out = torch.empty(last, self.columns)
        self.forward.blocks(model=self.model, cache=cache, ids=ids, positions=positions, start=start,
                            mask=None if mask is None else mask.contiguous().numpy(), last=last, out=out.numpy())
        return out

    def batch(self, parts: list[tuple]) -> list[torch.Tensor]:
        """Each part's logits, as `__call__` gives them for its arguments (cache, token_ids, position_ids, mask,
        start, last), from one forward over every part's rows: the weights are read once for all of them."""
        calls, asked = [], []
        for cache, token_ids, position_ids, mask, start, last in parts:
            ids = as_list(token_ids)
            asked.append(len(ids) if last is None else last)
            calls.append((cache, ids, as_list(position_ids), start,
                          None if mask is None else mask.contiguous().numpy(), asked[-1]))
        out = torch.empty(sum(asked), self.columns)
        self.forward.batch(model=self.model, parts=calls, out=out.numpy())
        return list(out.split(asked))

    def chains(self, parts: list[tuple], shortlist) -> list[tuple[list[int], list[Sparse] | None]]:
        """Chain drafters' draft forwards, each part a sequence's (cache, token_ids, position_ids, start, steps, sampling,
        uniforms), as one C++ call (forward.cpp's chains): a sequence's first forward is over its new nodes in cache
        slots from `start` (the last of them the root), each later one over the token chosen after the one before, a
        position and a slot further, `steps` of them; each step's forwards of every sequence run as one. Returns each
        part's chosen tokens (greedy: each row's argmax; a top-k setting: a draw at each of `uniforms`) and, when
        sampling, each one's distribution: what the part gets alone."""
        return self.forward.chains(
            model=self.model, shortlist_tokens=None if shortlist is None else shortlist.tokens,
            parts=[(cache, as_list(token_ids), as_list(position_ids), start, steps, sampling.top_k,
                    float(sampling.temperature), float(sampling.top_p), uniforms)
                   for cache, token_ids, position_ids, start, steps, sampling, uniforms in parts])
