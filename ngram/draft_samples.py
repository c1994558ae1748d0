"""Training text for the trigram sampled from the draft model (the paper: 120M tokens at T = 1.5),
so the trigram learns what the draft proposes rather than what the corpus says."""
from collections.abc import Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

from decode.errors import InputError
from decode.models.pretrained import load_causal_lm
from decode.tokenizer import load_tokenizer


def check_draft_tokenizer(model_dir, data_tokenizer_dir) -> None:
    """The draft must speak the data's tokenizer: the trigram's ids are the run's."""
    if load_tokenizer(model_dir).get_vocab() != load_tokenizer(data_tokenizer_dir).get_vocab():
        raise InputError(f"the draft in {model_dir} uses another tokenizer than the data's ({data_tokenizer_dir}); "
                         f"pass a draft trained on this run, or --data of the draft's run")


def sample_documents(
    model_dir, num_tokens: int, temperature: float, batch_size: int = 32, seed: int = 0
) -> Iterator[np.ndarray]:
    """Documents sampled from the model, each started at end-of-text and cut at the next one."""
    model = load_causal_lm(model_dir, "draft model (--from-draft)").eval()
    eos = load_tokenizer(model_dir).eos_token_id
    length = model.config.n_positions if hasattr(model.config, "n_positions") else model.config.max_position_embeddings
    torch.manual_seed(seed)
    produced = 0
    with tqdm(total=num_tokens, desc=f"sampling the draft at T={temperature}", unit="tok", unit_scale=True) as bar:
        while produced < num_tokens:
            start = torch.full((batch_size, 1), eos, dtype=torch.long)
            with torch.inference_mode():
                rows = model.generate(start, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                      max_new_tokens=length - 1, pad_token_id=eos)[:, 1:].numpy()
            for row in rows:
                ends = np.flatnonzero(row == eos)
                doc = row[: ends[0]] if ends.size else row
                produced += doc.size
                bar.update(doc.size)
                yield doc
                if produced >= num_tokens:
                    return
