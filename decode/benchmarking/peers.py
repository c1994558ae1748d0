"""The peers a user would otherwise pick, on the same checkpoints: transformers `generate` on the oracle
(`hf-generate`), assisted generation with the draft as assistant (`hf-assisted`, transformers'
default schedule) and prompt lookup (`hf-lookup`: `generate(prompt_lookup_num_tokens=...)`, drafts
copied from the context); llama.cpp through llama-cpp-python on the oracle exported to GGUF, plain
(`llamacpp`) and with its prompt-lookup draft (`llamacpp-lookup`); llama.cpp's own speculation through its
server binary (decode/benchmarking/llama_server.py). Each returns a Generation, with the
oracle's forward calls counted, and heals a prompt's last token as our methods do (the same
first-token constraint, as a logits processor). Each can say its own logit gap between two tokens
after a context, for the bench's near-tie check (`gaps`)."""
import importlib.util
import logging
import tempfile
from pathlib import Path
from typing import cast

import numpy as np
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from decode.benchmarking.llama_server import SERVER_PEERS, sampler
from decode.benchmarking.near_ties import CHUNKS, peer_gaps
from decode.healing import Prompt, constrain_first
from decode.loop import Generation
from decode.models.gguf_export import write_gguf
from decode.models.hf_backend import load_hf_model
from decode.models.runtime import runtime_for
from decode.sampling import Sampling

HF_PEERS = ("hf-generate", "hf-assisted", "hf-lookup")
LLAMACPP_PEERS = ("llamacpp", "llamacpp-lookup")
PEERS = HF_PEERS + LLAMACPP_PEERS + SERVER_PEERS
LLAMACPP_MISSING = 'llama-cpp-python and gguf are not installed (pip install -e ".[llamacpp]")'


class FirstTokenConstraint(LogitsProcessor):
    """Only `allowed` tokens at the first new position (the scores of a sequence `prompt_length` long)."""

    def __init__(self, allowed: torch.Tensor, prompt_length: int):
        self.allowed, self.prompt_length = allowed, prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        constrained = constrain_first(scores, self.allowed) if input_ids.shape[-1] == self.prompt_length else scores
        return cast(torch.FloatTensor, constrained)


def without_internal_deprecation(record: logging.LogRecord) -> bool:
    """Assisted generation calls the assistant's `generate` with a generation config and loose arguments
    both, and transformers warns that this is deprecated: its own call, which no caller can change."""
    return "Passing `generation_config` together with generation-related" not in record.getMessage()


logging.getLogger("transformers.generation.utils").addFilter(without_internal_deprecation)


class HFGenerate:
    def __init__(self, oracle_dir, draft_dir, sampling: Sampling, stop_ids: frozenset[int], dtype: str = "float32", device: str = "cpu",
                 lookup_tokens: int | None = None):
        """`draft_dir` None: plain generate, or prompt lookup of `lookup_tokens`; else assisted generation
        with that assistant."""
        self.oracle = load_hf_model(oracle_dir, dtype, device)
        self.runtime = runtime_for(device, self.oracle.dtype, cpp_forward=False)
        self.assistant = None if draft_dir is None else load_hf_model(draft_dir, dtype, device)
        self.sampling, self.stop_ids, self.lookup_tokens = sampling, sorted(stop_ids), lookup_tokens
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
        return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=self.stop_ids, pad_token_id=self.stop_ids[0],
                                prompt_lookup_num_tokens=self.lookup_tokens, **sampling)

    @torch.inference_mode()
    def __call__(self, prompt: Prompt, max_new_tokens: int, seed: int) -> Generation:
        torch.manual_seed(seed)
        self.calls = {"oracle": 0, "draft": 0}
        extra = {} if self.assistant is None else {"assistant_model": self.assistant}
        if prompt.allowed is not None:
            extra["logits_processor"] = LogitsProcessorList([FirstTokenConstraint(prompt.allowed, prompt.ids.numel())])
        with self.runtime.attention():  # the attention kernels our engine runs
            out = self.oracle.generate(prompt.ids[None], generation_config=self.generation_config(max_new_tokens), **extra)
        tokens = out[0, prompt.ids.numel():].tolist()
        return Generation(tokens, oracle_calls=self.calls["oracle"], draft_calls=self.calls["draft"])

    def gaps(self, context: list[int], a: int, b: int, prompt_length: int) -> list[float]:
        return peer_gaps(self.oracle, context, a, b, prompt_length)


def llamacpp_installed() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("llama_cpp", "gguf"))


class LlamaCpp:
    """llama.cpp's decoding of the oracle, exported to a temporary GGUF file in `dtype`, on `threads` threads: plain,
    or with its prompt-lookup draft of `lookup_tokens` (llama-cpp-python's LlamaPromptLookupDecoding)."""

    def __init__(self, oracle_dir, sampling: Sampling, eos_id: int, dtype: str, threads: int,
                 lookup_tokens: int | None = None):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.folder = tempfile.TemporaryDirectory(prefix="oracle-gguf-")  # removed with this object
        path = Path(self.folder.name) / "oracle.gguf"
        write_gguf(oracle_dir, path, dtype)
        draft = None if lookup_tokens is None else LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens)
        # n_ctx 0: the model's own context; one batch holds a whole context, so one eval is one forward
        self.llm = Llama(model_path=str(path), n_ctx=0, n_batch=4096, n_threads=threads, n_threads_batch=threads,
                         logits_all=draft is not None, draft_model=draft, verbose=False)
        self.sampling, self.eos_id, self.calls, self.nodes = sampling, eos_id, 0, 0
        evaluate = self.llm.eval

        def counted(tokens):
            self.calls, self.nodes = self.calls + 1, self.nodes + len(tokens)
            evaluate(tokens)

        self.llm.eval = counted  # generate() evaluates through it

    def sampler(self) -> dict:
        """llama-cpp-python's sampling arguments for ours: its defaults switched off."""
        return sampler(self.sampling, temperature="temp")

    def __call__(self, prompt: Prompt, max_new_tokens: int, seed: int) -> Generation:
        from llama_cpp import LogitsProcessorList

        self.llm.reset()  # no prefix reused from the previous prompt
        self.llm.set_seed(seed)
        self.calls = self.nodes = 0
        processors = None
        if prompt.allowed is not None:
            processors = LogitsProcessorList([first_token_only(prompt.allowed.cpu().numpy(), prompt.ids.numel())])
        generation = Generation()
        for token in self.llm.generate(prompt.ids.tolist(), logits_processor=processors, **self.sampler()):
            if generation.add([token], max_new_tokens, (self.eos_id,)):
                break
        generation.oracle_calls, generation.oracle_nodes = self.calls, self.nodes
        return generation

    def gaps(self, context: list[int], a: int, b: int, prompt_length: int) -> list[float]:
        """logit[a] - logit[b] after `context` as llama.cpp computes it: the prompt in one forward, then the tokens
        after it one at a time (plain decoding), then a few at a time (CHUNKS: as a lookup draft is scored)."""
        import llama_cpp

        gaps = []
        for chunk in (1, *CHUNKS):
            self.llm.reset()
            self.llm.eval(context[:prompt_length])
            for i in range(prompt_length, len(context), chunk):
                self.llm.eval(context[i : i + chunk])
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.llm.n_vocab(),))
            gaps.append(float(logits[a] - logits[b]))
        return gaps


def first_token_only(allowed: np.ndarray, prompt_length: int):
    """llama-cpp-python's logits processor for the healed first token: only `allowed` after the prompt itself."""

    def constrain(input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        if len(input_ids) != prompt_length:
            return scores
        kept = np.full_like(scores, -np.inf)
        kept[allowed] = scores[allowed]
        return kept

    return constrain
