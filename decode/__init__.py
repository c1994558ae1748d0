"""Staged speculative decoding: the oracle's output, decoded faster with drafts it verifies.

    from decode import SpeculativeDecoder

    api.py, options.py, methods.py   a decoder from its options; the methods and what each needs
    loop.py, tree.py, verify.py      the decoding loops, the drafted tree, and its verification
    sampling.py, healing.py          the processed distribution; token healing of a prompt's last token
    generation.py, server.py         transformers-style settings and streams; the OpenAI-compatible server
    models/                          the lean GPT-2 engine, its KV slots and runners, the transformers backend
    drafting/                        the drafters: chain, trees, staged, trigram, context
    native/                          the C++ of a step's loops and of a bfloat16 draft's forward
    planning/                        acceptance rates, replays, forward costs and the plan file
    cli/                             the commands (python -m decode.run, bench, plan, serve, ...)
"""
from decode.api import DecoderBusy, Result, SpeculativeDecoder
from decode.options import DecoderOptions

__all__ = ["DecoderBusy", "DecoderOptions", "Result", "SpeculativeDecoder"]
