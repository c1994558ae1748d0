"""Distillation windows whose tail the teacher wrote (sequence-level distillation, as in DistillSpec).

At decode time the draft reads the oracle's own output, not the corpus: greedy output repeats
itself, sampled output drifts, and a draft trained on corpus windows alone has never seen either.
A teacher window is a prefix followed by the teacher's continuation of it; the student is trained
on it with the same loss (a divergence to the teacher at every position) as on corpus windows. Prefixes are
random corpus windows, or prompts like the ones decoding gets (a function's signature and
docstring, harvested from the training split's files, never from the held-out prompts' files).
The pool is generated once before training and kept in the work directory, so a resumed run
trains on the same windows.
"""
import numpy as np
import torch
from tqdm.auto import tqdm

from data.corpus import Document
from data.harvest import harvest_file
from data.shards import token_dtype
from decode.errors import InputError

POOL_FILE = "teacher_windows.npz"


@torch.no_grad()
def teacher_continuations(teacher, prefixes: torch.Tensor, new_tokens: int, temperature: float, eos_id: int) -> torch.Tensor:
    """(n, P) prefixes -> (n, P + new_tokens): greedy when temperature is 0, else sampled at it (no top-k).
    The end-of-text token is suppressed so every window is full length. A static cache halves the cost of
    a step here (the default cache concatenates every layer's keys and values at every token)."""
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
    return teacher.generate(
        prefixes, attention_mask=torch.ones_like(prefixes), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        pad_token_id=eos_id, eos_token_id=eos_id, cache_implementation="static", **sampling,
    )


def random_prefixes(tokens: np.ndarray, count: int, length: int, rng: np.random.Generator) -> torch.Tensor:
    starts = rng.integers(0, len(tokens) - length + 1, size=count)
    return torch.stack([torch.from_numpy(tokens[s : s + length].astype(np.int64)) for s in starts])


def prompt_prefixes(tokens: np.ndarray, tokenizer, count: int, length: int, rng: np.random.Generator) -> torch.Tensor:
    """Prefixes of `length` tokens that end with a prompt harvested from one of the split's documents:
    the end of the document before it, the end-of-text token, then the prompt without its final
    newline (where token healing leaves a prompt). Prompts repeat when the split holds fewer."""
    ends = np.flatnonzero(tokens == tokenizer.eos_token_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    prefixes = []
    for i in rng.permutation(len(ends)):
        if starts[i] == 0:
            continue  # no document before it to fill the window from
        for prompt in harvest_file(Document(str(i), tokenizer.decode(tokens[starts[i] : ends[i]].tolist()))):
            ids = tokenizer.encode(prompt["prompt"].rstrip("\n"))
            if len(ids) < length <= starts[i] + len(ids):
                prefixes.append(np.concatenate([tokens[starts[i] - (length - len(ids)) : starts[i]], ids]))
        if len(prefixes) >= count:
            break
    if not prefixes:
        raise InputError("no function with a docstring found in the training split to harvest prompts from; "
                         "use --teacher-prefixes corpus")
    return torch.from_numpy(np.stack([prefixes[i % len(prefixes)] for i in range(count)]).astype(np.int64))


def build_pool(teacher, prefixes: torch.Tensor, new_tokens: int, temperature: float, eos_id: int, seed: int, batch_size: int,
               device, autocast) -> np.ndarray:
    """The teacher's continuations of `prefixes`, new_tokens each, as windows of the smallest unsigned integer type that
    holds every id of the teacher's output (data.shards.token_dtype: uint16 up to 65,536 tokens, else uint32)."""
    torch.manual_seed(seed)
    windows = []
    for batch in tqdm(prefixes.split(batch_size), desc="teacher continuations", unit="batch"):
        with autocast():
            windows.append(teacher_continuations(teacher, batch.to(device), new_tokens, temperature, eos_id).cpu())
    return torch.cat(windows).numpy().astype(token_dtype(teacher.config.vocab_size))


class PoolWindows(torch.utils.data.Dataset):
    def __init__(self, pool: np.ndarray):
        self.pool = pool

    def __len__(self) -> int:
        return len(self.pool)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.pool[i].astype(np.int64))
