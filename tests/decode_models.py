"""Tiny GPT-2 and Llama-family checkpoints for decoding tests: an oracle, a good draft (the oracle's weights plus a
little noise) and a bad one (independent weights). A large init range makes their predictions
depend on the context, so drafts really disagree with the oracle."""
import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from decode.loop import baseline
from decode.models.engine import GPT2Engine
from decode.models.loading import TOKEN_COUNTS
from decode.sampling import Sampling

# Prompts for a byte-level BPE run (see conftest.bpe_run): three end in a bare newline token.
PROMPTS = ['def scale_1(values, factor=1):\n    """Multiply every value by 1 and return the list."""\n',
           "import math\n", "class Box3:\n    def __init__(self):\n", "x = (1, 2"]


def tiny_gpt2(path, vocab_size=97, seed=0, noise_from=None, noise=0.0, n_positions=128, tokenizer=None,
              activation_function="gelu_new", n_embd=32, n_head=4):
    """`tokenizer` None: a word-level one over the ids ("t0 t5 t17"; t0 is end-of-text)."""
    torch.manual_seed(seed)
    eos = 0 if tokenizer is None else tokenizer.eos_token_id
    config = GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_layer=2, n_embd=n_embd, n_head=n_head,
                        initializer_range=0.3, bos_token_id=eos, eos_token_id=eos, activation_function=activation_function)
    model = GPT2LMHeadModel(config).eval()
    if noise_from is not None:
        model.load_state_dict(GPT2LMHeadModel.from_pretrained(noise_from).state_dict())
        with torch.no_grad():
            for p in model.parameters():
                p.add_(noise * torch.randn_like(p))
    return saved(model, path, vocab_size, tokenizer)


def saved(model, path, vocab_size: int, tokenizer=None):
    """`model` saved to `path` with `tokenizer`, or with a word-level one over its ids when None."""
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
        return path
    words = {f"t{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(words, unk_token="t1"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="t0", unk_token="t1").save_pretrained(path)
    return path


def tiny_llama(path, model_type="llama", vocab_size=97, seed=0, noise_from=None, noise=0.0, hidden_size=64, heads=4,
               kv_heads=2, intermediate_size=96, positions=128, tokenizer=None, **options):
    """A random-weight Llama-family model (`model_type` llama, qwen2 or mistral: Qwen2's q/k/v biases included),
    grouped-query attention (`kv_heads` of `heads`), its own output layer unless `options` ties it; with `noise_from`,
    that model's weights plus `noise` (a draft that mostly agrees with it). `tokenizer` as tiny_gpt2's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    eos = 0 if tokenizer is None else tokenizer.eos_token_id
    config = AutoConfig.for_model(model_type, vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=2,
                                  num_attention_heads=heads, num_key_value_heads=kv_heads,
                                  intermediate_size=intermediate_size, max_position_embeddings=positions,
                                  initializer_range=0.3, bos_token_id=eos, eos_token_id=eos, **options)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:  # random, so that a mistake in either shows
                p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
        if noise_from is not None:
            model.load_state_dict(AutoModelForCausalLM.from_pretrained(noise_from).state_dict())
            for p in model.parameters():
                p.add_(noise * torch.randn_like(p))
    return saved(model, path, vocab_size, tokenizer)


def oracle_and_good_draft(root, kind: str, **options):
    """A tiny oracle of `kind` (gpt2, or a Llama-family model_type, tiny_llama's `options`) in root/oracle and a good
    draft of it (its weights plus a little noise) in root/draft."""
    if kind == "gpt2":
        oracle = tiny_gpt2(root / "oracle", seed=0)
        return oracle, tiny_gpt2(root / "draft", seed=1, noise_from=oracle, noise=0.005)
    oracle = tiny_llama(root / "oracle", kind, seed=0, **options)
    return oracle, tiny_llama(root / "draft", kind, seed=1, noise_from=oracle, noise=0.005, **options)


def tiny_trigram(path, oracle_dir, documents=150, length=40, seed=0):
    """A Katz trigram over text sampled from the oracle, so it predicts the oracle somewhat."""
    from decode.models.loading import load_model
    from ngram import build_katz

    oracle = load_model(oracle_dir, "lean", "float32", "cpu")
    generator = torch.Generator().manual_seed(seed)
    lines = []
    for _ in range(documents):
        prompt = torch.randint(1, oracle.vocab_size, (3,), generator=generator)
        lines.append(" ".join(map(str, prompt.tolist() + baseline(oracle, prompt, length, Sampling(1.0), (), generator=generator).tokens)))
    tokens = path.parent / f"{path.name}.txt"
    tokens.write_text("\n".join(lines) + "\n")
    build_katz.main(["--tokens", str(tokens), "--vocab-size", str(oracle.vocab_size), "--eos-id", "0", "--out", str(path)])
    return path


def run_models(root) -> dict:
    """A run's decoding parts (oracle, good draft, trigram, 64-position context) and a model and a
    trigram of another vocabulary."""
    oracle = tiny_gpt2(root / "oracle", seed=0, n_positions=64)
    other = tiny_gpt2(root / "other", vocab_size=50, seed=2)
    draft = tiny_gpt2(root / "draft", seed=1, noise_from=oracle, noise=0.005, n_positions=64)
    ngram = tiny_trigram(root / "ngram", oracle)
    sampled = [int(t) for t in (root / "ngram.txt").read_text().split()]  # the oracle's text the trigram counted
    np.save(draft / TOKEN_COUNTS, np.bincount(sampled, minlength=97))  # what training writes beside a model
    return {
        "root": root,
        "oracle": oracle,
        "draft": draft,
        "ngram": ngram,
        "other_vocab": other,
        "other_ngram": tiny_trigram(root / "other_ngram", other, documents=20),
    }


def tree_models(root) -> dict:
    """An oracle, a draft close to it (good), an unrelated one (bad) and the oracle's trigram."""
    oracle = tiny_gpt2(root / "oracle", seed=0)
    return {
        "oracle": oracle, "good": tiny_gpt2(root / "good", seed=1, noise_from=oracle, noise=0.005),
        "bad": tiny_gpt2(root / "bad", seed=2), "ngram": tiny_trigram(root / "ngram", oracle),
    }


SHAPE = {"parents": [-1, 0, 0, 1, 1, 2, 3, 6], "ranks": [0, 0, 1, 0, 1, 0, 0, 0]}  # branches, then a chain


def oracle_contexts(models, count: int) -> list[list[int]]:
    """Prompts, each with the oracle's greedy continuation: text the trigram and the good draft often guess."""
    oracle = GPT2Engine.load(models["oracle"])
    rng = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 97, (int(torch.randint(1, 8, (), generator=rng)),), generator=rng) for _ in range(count)]
    return [p.tolist() + baseline(oracle, p, int(torch.randint(0, 12, (), generator=rng)), Sampling(), ()).tokens
            for p in prompts]
