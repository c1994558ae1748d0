"""A narrower student started from the teacher's weights, seen through the teacher's principal directions.

The teacher's token embeddings factor as wte = U S V^T. With V_d, their top d directions (d the student's
width), the student's residual stream starts as the teacher's projected on V_d: a token embeds as its row of
U_d S_d = wte V_d, a position as wpe V_d, and each block writes to the stream through V_d too. Embeddings
alone (`copy_teacher_embeddings`) make the tied output layer start as the teacher's best rank-d copy;
`copy_teacher_layers` also starts each of the student's blocks from one of the teacher's: what a block reads
from the stream is its input weights seen through V_d, what it writes is its output weights projected on
V_d, and its inner dimensions (heads, head dimensions, MLP units) are the teacher's first ones, as weight
selection (Xu et al. 2024, "Initializing Models with Larger Ones") takes them. At the teacher's width, with
V_d the identity, the student is the teacher (tested).
"""
import math

import torch

from decode.errors import InputError


def principal_directions(teacher, student) -> tuple[torch.Tensor, float]:
    """V_d (teacher width x student width) from the SVD of the teacher's token embeddings (the rows of the
    student's vocabulary: a hub teacher may pad its matrix), and the share of their squared norm V_d holds."""
    vocab, width = student.get_input_embeddings().weight.shape
    t_wte = teacher.get_input_embeddings().weight.detach().float().cpu()[:vocab]
    if width > t_wte.shape[1]:
        raise InputError(f"--teacher-embeddings: the student's --n-embd {width} exceeds the teacher's {t_wte.shape[1]}")
    _, s, vt = torch.linalg.svd(t_wte, full_matrices=False)
    return vt[:width].T, float(s[:width].square().sum() / s.square().sum())


def position_embeddings(model) -> torch.Tensor | None:
    """A GPT-2's learned position embeddings (None: a model with rotary positions, as the Llama family's)."""
    wpe = getattr(getattr(model, "transformer", None), "wpe", None)
    return None if wpe is None else wpe.weight


def check_gpt2(teacher, student, flag: str) -> None:
    if position_embeddings(teacher) is None or position_embeddings(student) is None:
        raise InputError(f"{flag} needs a GPT-2 teacher and student (learned position embeddings); a Llama-family "
                         f"student starts from the teacher's embeddings alone (--teacher-embeddings)")


@torch.no_grad()
def copy_teacher_embeddings(teacher, student, basis: torch.Tensor | None = None) -> None:
    """The student's embeddings as the teacher's seen through `basis` (default: their top n_embd principal
    directions V): a token's row of wte V (= U S), and for a GPT-2 a position's row of wpe V. The tied output layer's
    logits h . wte then start as those of the teacher's best rank-n_embd approximation, for a hidden state h in V.
    Teacher and student are of one family: both with learned positions (GPT-2), or both with rotary ones."""
    t_wpe, s_wpe = position_embeddings(teacher), position_embeddings(student)
    if (t_wpe is None) != (s_wpe is None):
        raise InputError("--teacher-embeddings needs a student of the teacher's family (a GPT-2 for a GPT-2, a "
                         "Llama-family model for a Llama-family one: --arch teacher)")
    s_wte = student.get_input_embeddings().weight
    basis = principal_directions(teacher, student)[0] if basis is None else basis
    s_wte.copy_((teacher.get_input_embeddings().weight.float().cpu()[: len(s_wte)] @ basis).to(s_wte))
    if t_wpe is not None and s_wpe is not None:
        positions = min(len(s_wpe), len(t_wpe))
        s_wpe[:positions].copy_((t_wpe.float().cpu()[:positions] @ basis).to(s_wpe))


def head_columns(teacher_heads: int, teacher_dim: int, heads: int, dim: int) -> torch.Tensor:
    """Indices, within one of q, k or v, of the first `dim` dimensions of each of the first `heads` heads."""
    return (torch.arange(heads)[:, None] * teacher_dim + torch.arange(dim)).flatten()


@torch.no_grad()
def copy_teacher_layers(teacher, student, basis: torch.Tensor | None = None, share: float = 1.0) -> None:
    """Student block i from teacher block i (its first n_layer blocks), and the final layer norm, through `basis`
    (default: the principal directions and their `share`, as `principal_directions` gives them). A layer norm's
    gain and bias fold into the weights that read its output (the student's norms start at gain 1, bias 0),
    which are then scaled by sqrt(share x teacher width / student width): about the root mean square of a
    normalised state of the teacher's width projected on V_d (`share`: of the embeddings' squared norm that V_d
    holds), where the student's normalised state has 1. Queries are scaled by sqrt(teacher head dim / student
    head dim) so that attention scores over fewer dimensions keep their scale."""
    check_gpt2(teacher, student, "--teacher-layers")
    t, s = teacher.config, student.config
    t_dim, s_dim = t.n_embd // t.n_head, s.n_embd // s.n_head
    t_units, s_units = t.n_inner or 4 * t.n_embd, s.n_inner or 4 * s.n_embd
    if s.n_layer > t.n_layer or s.n_head > t.n_head or s_dim > t_dim or s_units > t_units:
        raise InputError(f"--teacher-layers: the student ({s.n_layer} layers, {s.n_head} heads of {s_dim}, {s_units} MLP "
                         f"units) must be no larger than the teacher ({t.n_layer}, {t.n_head} of {t_dim}, {t_units}) in each")
    if basis is None:
        basis, share = principal_directions(teacher, student)
    scale = math.sqrt(share * t.n_embd / s.n_embd)
    columns = head_columns(t.n_head, t_dim, s.n_head, s_dim)
    qkv = torch.cat([columns, columns + t.n_embd, columns + 2 * t.n_embd])
    units = torch.arange(s_units)

    def reading(norm, linear, outputs: torch.Tensor, target, gain: torch.Tensor | float = 1.0) -> None:
        """target <- linear after norm, reading from the stream through the basis; `gain` scales its outputs."""
        weight, bias = linear.weight.float().cpu()[:, outputs], linear.bias.float().cpu()[outputs]
        target.bias.copy_((bias + norm.bias.float().cpu() @ weight) * gain)
        target.weight.copy_(basis.T @ (norm.weight.float().cpu()[:, None] * weight) * scale * gain)

    def writing(linear, inputs: torch.Tensor, target) -> None:
        """target <- linear, writing to the stream through the basis."""
        target.weight.copy_(linear.weight.float().cpu()[inputs] @ basis)
        target.bias.copy_(linear.bias.float().cpu() @ basis)

    query_gain = torch.ones(3 * s.n_embd)
    query_gain[: s.n_embd] = math.sqrt(t_dim / s_dim)
    for t_block, s_block in zip(teacher.transformer.h, student.transformer.h):
        reading(t_block.ln_1, t_block.attn.c_attn, qkv, s_block.attn.c_attn, query_gain)
        writing(t_block.attn.c_proj, columns, s_block.attn.c_proj)
        reading(t_block.ln_2, t_block.mlp.c_fc, units, s_block.mlp.c_fc)
        writing(t_block.mlp.c_proj, units, s_block.mlp.c_proj)
        for norm in (s_block.ln_1, s_block.ln_2):
            norm.weight.fill_(1.0)
            norm.bias.zero_()
    t_norm, s_norm = teacher.transformer.ln_f, student.transformer.ln_f
    s_norm.weight.copy_(scale * (basis.square() * t_norm.weight.float().cpu()[:, None]).sum(0))  # diag(V^T diag(g) V)
    s_norm.bias.copy_(t_norm.bias.float().cpu() @ basis)
