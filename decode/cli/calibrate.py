"""Measure once how this machine runs a run's models, and keep it: what every other command then reads.

    python -m decode.calibrate --run RUN
    python -m decode.calibrate --oracle DIR --draft DIR --dtype bfloat16

It times the oracle in float32 and in bfloat16 (the dtype --dtype auto then stands for), and, in the dtype each model
decodes in, every weight matrix's layouts and the C++ forward over 1 to 64 rows against torch's. The choices are kept
in ~/.cache/staged-speculative, per model, CPU, threads and code; decode.plan calibrates the same way before it plans.
Without a calibration, commands use the documented defaults (docs/decoding.md, "Calibration").
"""
import argparse

from decode.cli.flags import add_decoder_flags, decoder_flags
from decode.cli.help import HelpFormatter
from decode.errors import exits_on_input_error
from decode.models.calibration import calibrate
from decode.sampling import Sampling

PROG = "python -m decode.calibrate"


@exits_on_input_error
def main(argv=None) -> dict[str, str]:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    add_decoder_flags(p)
    args = p.parse_args(argv)
    args.no_plan = True  # the plan is what calibration comes before
    chosen = calibrate(decoder_flags(p, args, Sampling(), dtype_from_plan=False).options())
    for role, what in chosen.items():
        print(f"{role}: {what}")
    return chosen


if __name__ == "__main__":
    main()
