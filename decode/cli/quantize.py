"""Quantize a GPT-2 or a Llama-family model to llama.cpp's Q8_0 or Q4_0 blocks: a model directory every command loads
as it is.

    python -m decode.quantize --run RUN --to q8_0                  # RUN/oracle-q8_0 and RUN/draft-q8_0
    python -m decode.quantize --model DIR --to q4_0 --out DIR2      # a directory or a hub name
    python -m decode.run --run RUN --oracle RUN/oracle-q8_0 --draft RUN/draft-q8_0 --prompt "def f(x):"

The token embedding, the output layer and every block's matrices are quantized; position embeddings, norms and biases
stay float32. Decoding with a quantized oracle is exact against that quantized oracle: every method
gives its plain decoding's tokens. With a run (or --data), the perplexity of each model on the validation split is
printed beside its 16-bit source's.
"""
import argparse
import datetime
import json
from pathlib import Path

from decode.atomic import MODEL, atomic_outputs, check_output
from decode.cli.help import HelpFormatter
from decode.errors import InputError, check_path, exits_on_input_error
from decode.models.loading import load_model
from decode.models.model_config import read_config
from decode.models.pretrained import model_dir
from decode.models.quality import perplexity, validation_windows
from decode.models.quantize_model import check_quantizable, quantize_checkpoint
from decode.models.quantized import FORMATS
from decode.provenance import command_line

PROG = "python -m decode.quantize"
REPORT = "quantization.json"  # in a quantized model's directory: its format, source and perplexities (decode.report)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--run", type=Path, help="run directory: quantizes RUN/oracle and RUN/draft (when it exists) into "
                                            "RUN/oracle-FORMAT and RUN/draft-FORMAT, measured on RUN/data")
    p.add_argument("--model", help="a GPT-2 or Llama-family model directory or hub name to quantize (instead of --run)")
    p.add_argument("--to", choices=list(FORMATS), required=True,
                   help="the block format: q8_0 (8.5 bits a weight) or q4_0 (4.5 bits a weight)")
    p.add_argument("--out", type=Path, help="with --model: the directory to write")
    p.add_argument("--data", type=Path, help="a prepared data directory whose validation split measures perplexity "
                                             "(default: RUN/data with --run; none with --model)")
    p.add_argument("--eval-tokens", type=int, default=16384, help="validation tokens the perplexity is measured on (0: "
                                                                  "none)")
    p.add_argument("--overwrite", action="store_true", help="replace a model already at the output path")
    args = p.parse_args(argv)
    if (args.run is None) == (args.model is None):
        p.error("pass --run RUN, or --model DIR with --out DIR")
    if args.model is not None and args.out is None:
        p.error("--model needs --out, the directory the quantized model goes to")
    if args.run is not None and args.out is not None:
        p.error("--out goes with --model; with --run the models go to RUN/oracle-FORMAT and RUN/draft-FORMAT")
    if args.eval_tokens < 0:
        p.error("--eval-tokens must be 0 or more")
    return args


def models_of(args: argparse.Namespace) -> dict[str, tuple[Path, Path]]:
    """Each model to quantize: name -> (its directory, the quantized model's)."""
    if args.model is not None:
        return {"model": (model_dir(args.model, "--model"), args.out)}
    models = {name: (args.run / name, args.run / f"{name}-{args.to}") for name in ("oracle", "draft")}
    if not models["oracle"][0].is_dir():
        raise InputError(f"{args.run} has no oracle directory; pass a run directory (python -m data.prepare ...) or --model DIR")
    return {name: paths for name, paths in models.items() if paths[0].is_dir()}


def measured(source: Path, quantized: Path, windows: list[list[int]]) -> dict:
    """Both models' perplexities on the windows, each run by the engine decoding runs (float32 activations)."""
    got = {which: perplexity(load_model(directory, "lean", "float32", "cpu"), windows)
           for which, directory in (("source", source), ("quantized", quantized))}
    return got | {"tokens": sum(len(w) - 1 for w in windows)}


@exits_on_input_error
def main(argv=None) -> list[Path]:
    args = parse(argv)
    fmt = FORMATS[args.to]
    models = models_of(args)
    for name, (source, out) in models.items():
        check_path(source, True, f"{name} directory", f"pass the directory that holds the {name}")
        check_quantizable(source, read_config(source))
        check_output(out, MODEL, args.overwrite, "--out", {name: source})
    data = args.data or (args.run / "data" if args.run is not None else None)
    command = command_line(PROG, argv)
    with atomic_outputs([(out, MODEL) for _, out in models.values()], args.overwrite) as tmps:
        for (name, (source, out)), tmp in zip(models.items(), tmps):
            quantize_checkpoint(source, tmp, fmt)
            report: dict = {"model": name, "format": fmt.name, "bits_a_weight": fmt.bits, "source": str(source),
                            "date": datetime.date.today().isoformat(), "command": command}
            line = f"{name}: {source} -> {out} ({fmt.name}, {fmt.bits} bits a weight)"
            if data is not None and args.eval_tokens:
                config = read_config(source)  # a GPT-2's context, or a Llama-family model's
                window = min(256, config.get("n_positions") or config.get("max_position_embeddings", 256))
                windows = validation_windows(data, args.eval_tokens, window)
                report["perplexity"] = p = measured(source, tmp, windows)
                change = 100 * (p["quantized"] / p["source"] - 1)
                line += (f"; perplexity on {p['tokens']} validation tokens: {p['source']:.3f} -> {p['quantized']:.3f} "
                         f"({change:+.2f}%)")
            (tmp / REPORT).write_text(json.dumps(report, indent=2) + "\n")
            print(line, flush=True)
    if args.run is not None:
        oracle, draft = (models[name][1] if name in models else None for name in ("oracle", "draft"))
        plan = args.run / f"plan-{fmt.name}.json"
        print(f"plan for them: python -m decode.plan --run {args.run} --oracle {oracle}"
              f"{f' --draft {draft}' if draft else ''} --out {plan}")
        if draft:  # a draft only proposes: beside the 16-bit oracle the output stays that oracle's
            print(f"or for the 16-bit oracle with the {fmt.name} draft, whose output stays the oracle's: python -m "
                  f"decode.plan --run {args.run} --draft {draft} --out {args.run / f'plan-draft-{fmt.name}.json'}")
    return [out for _, out in models.values()]


if __name__ == "__main__":
    main()
