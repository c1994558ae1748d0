"""The peers a user would otherwise pick, on the same checkpoints: transformers `generate` on the oracle
(`hf-generate`), assisted generation with the draft as assistant (`hf-assisted`, transformers'
default schedule) and prompt lookup (`hf-lookup`: `generate(prompt_lookup_num_tokens=...)`, drafts
copied from the context). Each returns a Generation, with the oracle's forward calls counted by a
hook, and heals a prompt's last token as our methods do (the same first-token constraint, as a
logits processor)."""
import logging

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from decode.models.engine import attention_kernels
from decode.loop import Generation
from decode.healing import Prompt, constrain_first
from decode.models.hf_backend import load_hf_model
from decode.sampling import Sampling


class FirstTokenConstraint(LogitsProcessor):
    """Only `allowed` tokens at the first new position (the scores of a sequence `prompt_length` long)."""

    def __init__(self, allowed: torch.Tensor, prompt_length: int):
        self.allowed, self.prompt_length = allowed, prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return constrain_first(scores, self.allowed) if input_ids.shape[-1] == self.prompt_length else scores


def without_internal_deprecation(record: logging.LogRecord) -> bool:
    """Assisted generation calls the assistant's `generate` with a generation config and loose arguments
    both, and transformers warns that this is deprecated: its own call, which no caller can change."""
    return "Passing `generation_config` together with generation-related" not in record.getMessage()


logging.getLogger("transformers.generation.utils").addFilter(without_internal_deprecation)


class HFGenerate:
    def __init__(self, oracle_dir, draft_dir, sampling: Sampling, eos_id: int, dtype: str = "float32", device: str = "cpu",
                 lookup_tokens: int | None = None):
        """`draft_dir` None: plain generate, or prompt lookup of `lookup_tokens`; else assisted generation
        with that assistant."""
        self.oracle = load_hf_model(oracle_dir, dtype, device)
        self.assistant = None if draft_dir is None else load_hf_model(draft_dir, dtype, device)
        self.sampling, self.eos_id, self.lookup_tokens = sampling, eos_id, lookup_tokens
        self.calls = {"oracle": 0, "draft": 0}
        self.oracle.register_forward_pre_hook(lambda *_: self._count("oracle"))
        if self.assistant is not None:
            self.assistant.register_forward_pre_hook(lambda *_: self._count("draft"))

    def _count(self, model: str) -> None:
        self.calls[model] += 1

    def generation_config(self, max_new_tokens: int):
        from transformers import GenerationConfig

        s = self.sampling
        sampling = {"do_sample": False} if s.greedy else {"do_sample": True, "temperature": s.temperature,
                                                           "top_k": s.top_k or None, "top_p": s.top_p}
        return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=self.eos_id, pad_token_id=self.eos_id,
                                prompt_lookup_num_tokens=self.lookup_tokens, **sampling)

    @torch.inference_mode()
    def __call__(self, prompt: Prompt, max_new_tokens: int, seed: int) -> Generation:
        torch.manual_seed(seed)
        self.calls = {"oracle": 0, "draft": 0}
        extra = {} if self.assistant is None else {"assistant_model": self.assistant}
        if prompt.allowed is not None:
            extra["logits_processor"] = LogitsProcessorList([FirstTokenConstraint(prompt.allowed, prompt.ids.numel())])
        with attention_kernels(self.oracle.device):  # the attention kernels our engine runs on a GPU
            out = self.oracle.generate(prompt.ids[None], generation_config=self.generation_config(max_new_tokens), **extra)
        tokens = out[0, prompt.ids.numel():].tolist()
        return Generation(tokens, oracle_calls=self.calls["oracle"], draft_calls=self.calls["draft"])
