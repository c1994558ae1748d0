"""How long one short prompt takes from a command's start: `python -m decode.run ... --stream` in fresh processes,
from its start to its models loaded (the prompt echoed), to its first new token and to its exit, with its peak
resident memory, beside a process that only imports torch (the floor under every command). The two are taken in
turns and the medians reported. Every flag but --prompt, --repeats, --out and --overwrite is decode.run's.

    python -m decode.profile_start --run RUN --method staged --prompt "def add(a, b):" --max-new-tokens 64
"""
import argparse
import datetime
import shlex
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from decode.atomic import check_output, write_json
from decode.benchmarking.startup import FLOOR, profile_start
from decode.cli.help import HelpFormatter
from decode.cli.settings import parse_settings
from decode.devices import machine_name
from decode.errors import InputError, exits_on_input_error
from decode.provenance import provenance

PROG = "python -m decode.profile_start"


@exits_on_input_error
def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter,
                                epilog="decode.run's flags choose the run, the method and the tokens (see its --help)")
    p.add_argument("--prompt", required=True, help="the prompt each decode.run process decodes")
    p.add_argument("--repeats", type=int, default=5, help="fresh processes of each kind")
    p.add_argument("--out", type=Path, help="write the figures as JSON here")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args, run_flags = p.parse_known_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1 (got {args.repeats})")
    if args.out:
        check_output(args.out, overwrite=args.overwrite, flag="--out")
    command = ["-m", "decode.run", *run_flags, "--prompt", args.prompt, "--stream"]
    parse_settings(command[2:], "python -m decode.run", "")  # decode.run's checks of its flags, before any process
    with tqdm(total=args.repeats, desc="fresh processes", unit="pair", file=sys.stderr) as bar:
        try:
            figures = profile_start(command, args.prompt, args.repeats, lambda done: bar.update(done - bar.n))
        except RuntimeError as err:
            raise InputError(f"{err}; run that command alone to see why") from None
    result = {"settings": {"command": f"{PROG} {shlex.join(argv if argv is not None else sys.argv[1:])}",
                           "decoding": shlex.join(["python", *command]), "floor": shlex.join(["python", *FLOOR]),
                           "repeats": args.repeats, "machine": machine_name(torch.device("cpu")),
                           "date": datetime.date.today().isoformat(),
                           **provenance()},
              "startup": figures}
    for name, shown in (("floor", result["settings"]["floor"]), ("command", result["settings"]["decoding"])):
        m = figures[name]["median"]
        steps = "".join(f"{label} {m[key]:.2f} s, " for key, label in (("loaded", "models loaded"),
                                                                      ("first_token", "first token")) if m[key] is not None)
        print(f"{shown}: {steps}exit {m['exit']:.2f} s, peak {m['peak_rss_mb']:.0f} MiB (medians of {args.repeats})")
    if args.out:
        write_json(args.out, result, args.overwrite)
    return result


if __name__ == "__main__":
    main()
