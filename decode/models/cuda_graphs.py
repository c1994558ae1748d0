"""CUDA graphs for the lean engine: a forward replayed as one launch instead of a dozen kernels per layer.

At batch one a GPU spends a small model's forward launching kernels, a dozen a layer, each taking longer to
launch than its arithmetic takes to run (docs/gpu.md). A graph records the launches
once and replays them, but it needs fixed shapes and fixed addresses. So a forward of q new nodes after
`start` cached slots is padded to a bucket: q up to the next of NODE_BUCKETS, the attended slots 0..end
up to a multiple of SLOT_BLOCK (or the whole cache). The padding nodes see only slot 0, write their keys and values into the
free slots right after the real ones (which nothing sees before a later forward overwrites them), and
their logits are dropped. Each bucket has its own input buffers and graph, captured the first time it
is needed; a forward past the largest bucket (a prompt's prefill) runs without one.
"""
import torch

NODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SLOT_BLOCK = 256


class BucketForward:
    """The engine's forward over fixed buffers for up to `nodes` new nodes attending to `slots` slots."""

    def __init__(self, engine, nodes: int, slots: int, capture: bool, pool):
        device = engine.device
        self.engine, self.capture, self.pool = engine, capture, pool
        self.recorded: tuple[torch.cuda.CUDAGraph, torch.Tensor] | None = None  # the graph and its output
        self.token_ids = torch.zeros(nodes, dtype=torch.long, device=device)
        self.position_ids = torch.zeros(nodes, dtype=torch.long, device=device)
        self.slots = torch.zeros(nodes, dtype=torch.long, device=device)
        self.mask = torch.zeros(nodes, slots, dtype=torch.bool, device=device)

    def run(self) -> torch.Tensor:
        return self.engine.logits(self.token_ids, self.position_ids, self.mask, self.slots, self.mask.shape[1])

    def __call__(self, token_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None, start: int,
                 end: int) -> torch.Tensor:
        """Logits of q = end - start new nodes written into slots start..end; `mask` (q, k) over the last k of
        slots 0..end as the engine builds it (every earlier slot is seen), None when each sees every slot."""
        q, nodes = token_ids.numel(), self.slots.numel()
        self.token_ids[:q] = token_ids
        self.position_ids[:q] = position_ids
        torch.arange(start, start + nodes, out=self.slots)
        self.mask.zero_()
        self.mask[:, 0] = True
        self.mask[:q, :end] = True
        if mask is not None:
            self.mask[:q, end - mask.shape[1] : end] = mask
        if not self.capture:
            return self.run()[:q]
        if self.recorded is None:
            self.recorded = self.record()
        graph, logits = self.recorded
        graph.replay()
        return logits[:q].clone()  # the next replay writes over the graph's output

    def record(self) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The graph of this bucket's forward, captured now, and the logits it writes."""
        side = torch.cuda.Stream(self.engine.device)
        side.wait_stream(torch.cuda.current_stream(self.engine.device))
        with torch.cuda.stream(side):  # warm-up outside the graph: first calls allocate workspaces
            self.run()  # writes the slots this call is about to write anyway
        torch.cuda.current_stream(self.engine.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.run()
        return graph, logits


class CUDAGraphs:
    """An engine's bucketed forwards; `capture=False` runs the same padded forwards without graphs (on any
    device: what the tests compare with the engine's own forward)."""

    def __init__(self, engine, capture: bool = True):
        self.engine, self.capture = engine, capture
        self.buckets: dict[tuple[int, int], BucketForward] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def get(self, q: int, start: int, end: int) -> BucketForward | None:
        """The forward for q new nodes in slots start..end, or None when none fits."""
        nodes = next((n for n in NODE_BUCKETS if n >= q), None)
        slots = min(-(-end // SLOT_BLOCK) * SLOT_BLOCK, self.engine.capacity)
        if nodes is None or start + nodes > self.engine.capacity:
            return None
        key = (nodes, slots)
        if key not in self.buckets:
            self.buckets[key] = BucketForward(self.engine, nodes, slots, self.capture, self.pool)
        return self.buckets[key]
