"""The configs of new models (not started from a checkpoint): a GPT-2, or a Llama-family model (Llama, Qwen2,
Mistral: RMS norms, rotary positions, SwiGLU MLPs, grouped-query attention), each of a --n-layer x --n-embd shape. A
draft distilled from a Llama-family oracle is of the oracle's family by default (--arch teacher): the lean engine runs
both, and the draft shares the oracle's rotary positions."""
import math

from decode.errors import InputError
from decode.models.llama import MODEL_TYPES
from decode.models.pretrained import FUSED_GELU

ARCHITECTURES = ("gpt2", *MODEL_TYPES)


def family_of(config) -> str:
    """A transformers config's architecture, as --arch names it (gpt2 for anything outside the Llama family)."""
    return config.model_type if config.model_type in MODEL_TYPES else "gpt2"


def swiglu_width(n_embd: int) -> int:
    """A SwiGLU MLP's inner width with about a GPT-2 MLP's weights (8/3 n_embd, three matrices for its two), in
    multiples of 32: the quantized blocks' length."""
    return 32 * math.ceil(8 * n_embd / 3 / 32)


def model_config(arch: str, n_layer: int, n_head: int, n_kv_head: int, n_embd: int, vocab_size: int, context: int,
                 eos_id: int, dropout: float = 0.0, teacher=None):
    """The transformers config of a new model of this shape. A Llama-family one has `n_kv_head` key/value heads (0:
    half its heads, at least one), a tied output layer, and, given a `teacher` of its family, the teacher's rotary
    positions, norm epsilon and context (else `context` positions)."""
    from transformers import AutoConfig

    if arch not in ARCHITECTURES:
        raise InputError(f"--arch {arch!r}: choose one of {', '.join(ARCHITECTURES)} (or teacher, for a draft)")
    if n_embd % n_head:
        raise InputError(f"--n-embd {n_embd} is not divisible by --n-head {n_head}")
    if arch == "gpt2":
        return AutoConfig.for_model("gpt2", vocab_size=vocab_size, n_positions=context, n_layer=n_layer, n_head=n_head,
                                    n_embd=n_embd, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                    bos_token_id=eos_id, eos_token_id=eos_id, activation_function=FUSED_GELU)
    kv_heads = n_kv_head or max(1, n_head // 2)
    if n_head % kv_heads or (n_embd // n_head) % 2:
        raise InputError(f"--n-head {n_head} must be a multiple of --n-kv-head {kv_heads}, and each head's width "
                         f"(--n-embd / --n-head = {n_embd // n_head}) even, for rotary positions")
    same_family = teacher is not None and teacher.model_type == arch
    rotary = {"rope_parameters": dict(teacher.rope_parameters), "rms_norm_eps": teacher.rms_norm_eps,
              "max_position_embeddings": teacher.max_position_embeddings} if same_family else \
             {"max_position_embeddings": context}
    return AutoConfig.for_model(arch, vocab_size=vocab_size, hidden_size=n_embd, num_hidden_layers=n_layer,
                                num_attention_heads=n_head, num_key_value_heads=kv_heads,
                                intermediate_size=swiglu_width(n_embd), tie_word_embeddings=True,
                                attention_dropout=dropout, bos_token_id=eos_id, eos_token_id=eos_id, **rotary)
