"""The models a decoder runs: the interface every one offers (`cached_lm`), the lean GPT-2 engine with its KV slots,
weight layouts and CUDA graphs, the transformers backend, loading them, and the dtype they run in."""
