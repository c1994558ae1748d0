"""The roofline of a forward of q new rows on this machine: the time no kernel can beat, from the bytes the forward
must read (every weight once, and the cached keys and values) at the measured memory bandwidth, and the
multiply-adds it must do at the measured peak rate. Beside a measured cost curve it says how far each forward is
from what the machine allows, and which bound (memory or arithmetic) decides it.
"""
import time
from dataclasses import dataclass

import torch

BANDWIDTH_BYTES = 256 * 2**20  # a read far past any cache
PEAK_SIZES = (512, 1024)  # square products whose operands stay in cache; the larger ran faster, torch's blocking
# paying off


@dataclass(frozen=True)
class Machine:
    bandwidth: float  # bytes a second, reading memory with torch's threads
    macs: float  # multiply-adds a second, torch's threads on products that stay in cache
    peak_dtype: str  # the dtype the peak was measured in


def best_seconds(work, repeats: int) -> float:
    work()  # warm: pages touched, kernels chosen
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best


def measure_machine(dtype: torch.dtype, repeats: int = 10) -> Machine:
    """This machine's memory bandwidth (the fastest of `repeats` sums over 256 MB) and peak multiply-add rate (the
    fastest of float32's and `dtype`'s square products of PEAK_SIZES in torch, 4 a timing, `repeats` timings)."""
    data = torch.ones(BANDWIDTH_BYTES // 4)
    bandwidth = BANDWIDTH_BYTES / best_seconds(data.sum, repeats)
    rates: dict[torch.dtype, float] = {}
    for kind in {torch.float32, dtype}:
        for size in PEAK_SIZES:
            a, b = torch.randn(size, size, dtype=kind), torch.randn(size, size, dtype=kind)
            rate = 4 * size**3 / best_seconds(lambda a=a, b=b: [torch.mm(a, b) for _ in range(4)], repeats)
            rates[kind] = max(rates.get(kind, 0.0), rate)
    fastest = max(rates, key=rates.__getitem__)
    return Machine(bandwidth, rates[fastest], str(fastest).removeprefix("torch."))


@dataclass(frozen=True)
class ForwardShape:
    n_layer: int
    n_embd: int
    block_weights: int  # the weights of a block's products
    kv_width: int  # a position's keys (or values) in a layer
    logit_columns: int
    element_bytes: int  # of the cache
    weight_bytes: float  # of a weight: its dtype's, or a quantized format's share of its block

    @classmethod
    def of(cls, engine) -> "ForwardShape":
        s = engine.shape
        columns = s.vocab_size if engine.shortlist is None else len(engine.shortlist.tokens)
        return cls(s.n_layer, s.n_embd, s.block_weights, s.kv_width, columns, engine.dtype.itemsize,
                   engine.runtime.weight_bytes)

    def work(self, q: int, cached: int) -> tuple[float, float]:
        """(bytes read, multiply-adds) of a forward of q new rows after `cached` positions: every weight and the
        cache's keys and values once; each row's products and its attention over the cache and the new rows."""
        n, layers, kv = self.n_embd, self.n_layer, self.kv_width
        weights = self.block_weights * layers + n * self.logit_columns
        seen = cached + q
        # attention: each query's scores and sums over the seen keys and values, its heads as wide as n_embd together
        attention = 2 * layers * seen * n
        return weights * self.weight_bytes + 2 * layers * seen * kv * self.element_bytes, q * (weights + attention)

    def roofline_ms(self, machine: Machine, q: int, cached: int) -> float:
        read, macs = self.work(q, cached)
        return 1e3 * max(read / machine.bandwidth, macs / machine.macs)


def knee(shape: ForwardShape, machine: Machine, cached: int) -> int:
    """The fewest rows from which a forward's multiply-adds take longer than its reads."""
    q = 1
    while q < 4096 and shape.work(q, cached)[1] / machine.macs < shape.work(q, cached)[0] / machine.bandwidth:
        q += 1
    return q
