"""The CachedLM interface over any transformers causal LM (Llama, GPT-2, ...): 4D additive masks,
explicit position ids, and a cache compacted by gathering the kept slots. Slower than the lean
GPT-2 engine (framework overhead per call), and exact."""
import copy
import inspect

import torch

from decode.models.cached_lm import CachedLM
from decode.models.engine import DTYPES
from decode.models.pretrained import load_causal_lm
from decode.models.runtime import runtime_for
from decode.shortlist import Shortlist
from decode.tensors import Ids, as_tensor


def load_hf_model(model_dir, dtype: str, device: str):
    """A transformers causal LM in inference mode on `device`, with a one-line error when it cannot load."""
    return load_causal_lm(model_dir, "model", dtype=DTYPES[dtype]).to(device).eval()


def cache_keyword(model) -> str:
    """The name a transformers model's forward takes its KV cache by, and returns it under: `cache` since
    transformers 5.24, `past_key_values` before (the old name warns until its removal in 5.40)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class HFEngine(CachedLM):
    def __init__(self, model_dir, dtype: str = "float32", device: str = "cpu", max_length: int | None = None,
                 shortlist: Shortlist | None = None, tokens: int | None = None):
        """With a `shortlist`, forward returns its tokens' logits (selected from the whole vocabulary's); with
        `tokens`, the model's input and output rows past the first `tokens` (padding) are left out."""
        from transformers import DynamicCache

        self.model = load_hf_model(model_dir, dtype, device)
        config = self.model.config
        if tokens is not None and tokens < config.vocab_size:
            self.model.resize_token_embeddings(tokens)
        self.device, self.dtype = torch.device(device), self.model.dtype
        self.runtime = runtime_for(self.device, self.dtype, cpp_forward=False)  # transformers' forward; the step's loops
        self.vocab_size = config.vocab_size
        # GPT-2's context is n_positions, the others' max_position_embeddings
        self.max_length = max_length or getattr(config, "max_position_embeddings", None) or config.n_positions
        self._new_cache = DynamicCache
        self.cache_keyword = cache_keyword(self.model)
        self.cache = DynamicCache()
        self.length = self.pending = 0
        self.shortlist = shortlist
        self.columns = None if shortlist is None else shortlist.tokens_on(self.device)

    @classmethod
    def load(cls, model_dir, dtype: str = "float32", device: str = "cpu", max_length: int | None = None,
             shortlist: Shortlist | None = None, tokens: int | None = None) -> "HFEngine":
        return cls(model_dir, dtype, device, max_length, shortlist, tokens)

    def reset(self) -> None:
        super().reset()
        self.cache = self._new_cache()

    def fork(self, slots: int | None = None) -> "HFEngine":  # its cache grows as it needs
        fork = copy.copy(self)
        fork.reset()
        return fork

    @torch.inference_mode()
    def forward(self, token_ids: Ids, position_ids: Ids, mask: torch.Tensor | None,
                last: int | None = None) -> torch.Tensor:
        token_ids, position_ids = as_tensor(token_ids, self.device), as_tensor(position_ids, self.device)
        q = token_ids.numel()
        start = self.length + self.pending
        if mask is None:
            mask = torch.ones(q, start + q, dtype=torch.bool, device=self.device).tril(start)
        else:  # over the pending slots and the new nodes: every committed position is visible
            mask = torch.cat([torch.ones(q, self.length, dtype=torch.bool, device=self.device), mask], 1)
        dtype = self.model.dtype
        additive = torch.zeros(mask.shape, dtype=dtype, device=self.device).masked_fill(~mask, torch.finfo(dtype).min)
        with self.runtime.attention():
            out = self.model(
                input_ids=token_ids[None], position_ids=position_ids[None], attention_mask=additive[None, None],
                use_cache=True, **{self.cache_keyword: self.cache},
            )
        self.cache = out[self.cache_keyword]
        self.pending += q
        logits = (out.logits[0] if last is None else out.logits[0, q - last :]).float()
        return logits if self.columns is None else logits[:, self.columns]

    @torch.inference_mode()
    def commit(self, keep: list[int]) -> None:
        kept = torch.tensor(keep, dtype=torch.long, device=self.device)
        index = torch.cat([torch.arange(self.length, device=self.device), self.length + kept])
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(-2, index)  # type: ignore[union-attr]  # a causal LM's attention cache
            layer.values = layer.values.index_select(-2, index)  # type: ignore[union-attr]
        self.length += len(keep)
        self.pending = 0
