"""Export a run's oracle and draft as GGUF files, for llama.cpp, llama-server and Ollama.

    python -m decode.export --run RUN --to gguf                      # RUN/gguf/oracle.gguf and draft.gguf
    python -m decode.export --run RUN --to gguf --dtype bfloat16 --out DIR
    python -m decode.export --oracle RUN/oracle-q8_0 --out DIR       # a quantized model: its own blocks
    python -m decode.export --run RUN --dtype q8_0 --out DIR         # quantized as decode.quantize would
    llama-server -m RUN/gguf/oracle.gguf -md RUN/gguf/draft.gguf      # speculative decoding in llama.cpp

Needs the gguf package (pip install -e ".[llamacpp]").
"""
import argparse
import importlib.util
from pathlib import Path

from decode.atomic import FILE, atomic_outputs, check_output
from decode.cli.help import HelpFormatter
from decode.errors import InputError, check_path, exits_on_input_error
from decode.models.gguf_export import GGUF_DTYPES, write_gguf
from decode.models.model_config import read_config
from decode.models.pretrained import model_dir
from decode.models.quantized import FORMATS, format_of

PROG = "python -m decode.export"


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--run", type=Path, help="run directory: exports RUN/oracle and RUN/draft")
    p.add_argument("--oracle", help="the oracle's directory or hub name (default: RUN/oracle)")
    p.add_argument("--draft", help="the draft's directory or hub name (default: RUN/draft, when it exists)")
    p.add_argument("--to", choices=["gguf"], default="gguf", help="the format")
    p.add_argument("--dtype", choices=[*GGUF_DTYPES, *FORMATS], default="float32",
                   help="the weight matrices' dtype in the files, or a block format a 16-bit model's are quantized to "
                        "as decode.quantize quantizes them (a quantized model's stay in its blocks)")
    p.add_argument("--draft-dtype", choices=[*GGUF_DTYPES, *FORMATS],
                   help="the draft's, where it differs (default: --dtype's)")
    p.add_argument("--out", type=Path, help="the directory the files go into (default: RUN/gguf)")
    p.add_argument("--overwrite", action="store_true", help="replace existing files")
    args = p.parse_args(argv)
    args.oracle = args.oracle and model_dir(args.oracle, "--oracle")
    args.draft = args.draft and model_dir(args.draft, "--draft")
    if args.run is not None:
        args.oracle = args.oracle or args.run / "oracle"
        draft = args.run / "draft"
        args.draft = args.draft or (draft if draft.is_dir() else None)
        args.out = args.out or args.run / "gguf"
    if args.oracle is None or args.out is None:
        p.error("pass --run RUN, or --oracle DIR and --out DIR")
    return args


@exits_on_input_error
def main(argv=None) -> list[Path]:
    args = parse(argv)
    if importlib.util.find_spec("gguf") is None:  # an optional dependency: said before any work
        raise InputError('the GGUF export needs the gguf package: pip install -e ".[llamacpp]" (or pip install gguf)')
    models = {"oracle": args.oracle} | ({"draft": args.draft} if args.draft is not None else {})
    for name, directory in models.items():
        check_path(directory, True, f"{name} directory", f"pass the directory that holds the {name}")
    paths = [args.out / f"{name}.gguf" for name in models]
    for path in paths:
        check_output(path, FILE, args.overwrite, "--out", models)
    with atomic_outputs([(path, FILE) for path in paths], args.overwrite) as tmps:
        for (name, directory), tmp in zip(models.items(), tmps):
            fmt = format_of(read_config(directory), directory)
            dtype = args.draft_dtype if name == "draft" and args.draft_dtype else args.dtype
            print(f"{name}: {directory} -> {args.out / f'{name}.gguf'} ({fmt.name if fmt else dtype})")
            write_gguf(directory, tmp, dtype)
    return paths


if __name__ == "__main__":
    main()
