"""Staged speculative decoding: the oracle's output, decoded faster with drafts it verifies.

    from decode import SpeculativeDecoder

    api.py, options.py, methods.py   a decoder from its options; the methods, what each needs, their checks
    resolution.py, plan_file.py      the options a run's flags and plans resolve to; the plan file read and written
    devices.py                       what differs by the kind of device asked for, before a model is loaded
    loop.py, tree.py, verify.py      the decoding loops, the drafted tree, and its verification
    sampling.py, healing.py          the processed distribution; token healing of a prompt's last token
    generation.py                    transformers-style settings and streams
    models/                          the lean GPT-2 engine, its runtime (kernels, C++ forward, KV moves), quantized weights
                                     (Q8_0, Q4_0), the transformers backend
    kernels/                         the step's loops over logits and trees: C++ and portable, one interface
    drafting/                        the drafters: chain, trees, staged, trigram, context
    native/                          the C++ of a step's loops and of a model's forward over a few rows (16-bit or quantized)
    planning/                        the planner: acceptance rates, replays, forward costs, the in-loop measurement
    timing/                          measuring: a model's forward, a step's parts, methods in turns; measurements kept
    benchmarking/                    the benchmark's output comparison, its peers (transformers, llama.cpp) and its tables
    serving/                         the OpenAI-compatible server
    cli/                             the commands (python -m decode.run, bench, plan, serve, ...), thin over the above
"""
import os
import tempfile

from decode.machine import AS_CPU

if os.environ.get(AS_CPU) == "avx2":  # torch's own kernels on AVX2 too, where torch is not loaded yet
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
    # torch.compile's kernels in a cache of their own: that cache's keys leave out the vector width
    # ATEN_CPU_CAPABILITY picks, so a kernel built for this CPU's own would be taken for AVX2's and the reverse
    # (wrong sums, NaN losses, corrupted memory)
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{os.getuid()}"))
    if os.path.basename(cache) != "avx2-alone":  # (a child process inherits it set)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "avx2-alone")

from decode.api import DecoderBusy, Result, SpeculativeDecoder  # noqa: E402
from decode.options import DecoderOptions  # noqa: E402

__all__ = ["DecoderBusy", "DecoderOptions", "Result", "SpeculativeDecoder"]
