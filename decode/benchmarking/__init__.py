"""The benchmark as a library: each method's output against the baseline's (comparison), the peers it measures
against (transformers' generate, llama.cpp in-process and as llama-server), the near-tie checker that tells a
rounding difference from a wrong token, many clients at once (load) and where their steps' time goes (batch_steps),
and the tables and sentences its results print as."""
