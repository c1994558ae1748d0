"""How long a batched successor lookup takes per context.

    python -m ngram.bench_lookup RUN/ngram
"""
import argparse
import time

import numpy as np

from decode.cli.help import HelpFormatter
from decode.errors import exits_on_input_error
from decode.models.successors import SuccessorTable


def lookup_cost_us(table: SuccessorTable, batch: int = 64, seconds: float = 0.2) -> float:
    """Microseconds per context of batched lookups of seen trigram histories."""
    rng = np.random.default_rng(0)
    keys = rng.choice(table.histories, batch)
    u, v = keys // (table.vocab_size + 2), keys % (table.vocab_size + 2)
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        table.lookup(u, v)
        calls += 1
    return (time.perf_counter() - start) / (calls * batch) * 1e6


@exits_on_input_error
def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m ngram.bench_lookup", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("ngram_dir", help="directory written by ngram/build_katz.py")
    args = p.parse_args(argv)
    table = SuccessorTable.load(f"{args.ngram_dir}/successors.npz")
    print(f"{table.histories.size:,} trigram histories, top-{table.k} successors")
    print("batch  us/context")
    for batch in (1, 4, 16, 64, 256, 1024):
        print(f"{batch:5d}  {lookup_cost_us(table, batch):9.3f}")


if __name__ == "__main__":
    main()
