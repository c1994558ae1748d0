"""Write a GPT-2 or a Llama-family model of a given shape with random weights and a run's tokenizer: a checkpoint for
measuring what decoding costs at a size not trained here, never for text.

    python -m decode.shaped --shape gpt2-large --tokenizer runs/default/tokenizer --out runs/gpt2-large-shaped
    python -m decode.bench --oracle runs/gpt2-large-shaped --prompts runs/default/prompts.jsonl \\
        --methods baseline,llamacpp-server --dtype bfloat16 --limit 5 --max-new-tokens 64

Its forwards cost what a trained model's of that shape do; its tokens are noise. The vocabulary is the tokenizer's
(a shape's own is replaced), so that prompts encode; config.json says `"random_weights": true`.
"""
import argparse
from pathlib import Path

import torch

from decode.atomic import MODEL, atomic_output, check_output
from decode.cli.help import HelpFormatter
from decode.errors import exits_on_input_error
from decode.models.llama import SHAPES, random_checkpoint
from decode.planning.costs import PROJECTIONS, projection_shape, random_weights
from decode.tokenizer import load_tokenizer

PROG = "python -m decode.shaped"
README = """# A cost-only checkpoint

Random weights in the shape of {shape} ({n_layer} layers x {n_embd}, vocabulary {vocab}), written by
`{prog}`: for measuring what decoding costs at this size (decode.bench, decode.bench_engine). Its tokens are noise.
"""


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--shape", required=True, help=f"a GPT-2 ({', '.join(PROJECTIONS)} or n_layer,n_embd,vocab) or a "
                                                  f"Llama-family model ({', '.join(SHAPES)}); the vocabulary is the "
                                                  f"tokenizer's either way")
    p.add_argument("--tokenizer", required=True, help="a tokenizer directory (e.g. RUN/tokenizer) or hub name")
    p.add_argument("--out", type=Path, required=True, help="the checkpoint directory to write")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="the weights' dtype in the file")
    p.add_argument("--seed", type=int, default=0, help="the random weights' seed")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint already at --out")
    args = p.parse_args(argv)
    if args.shape in SHAPES:
        args.n_layer, args.n_embd = SHAPES[args.shape]["num_hidden_layers"], SHAPES[args.shape]["hidden_size"]
    else:
        args.n_layer, args.n_embd, _ = projection_shape(args.shape, "--shape")
    return args


@exits_on_input_error
def main(argv=None) -> Path:
    args = parse(argv)
    check_output(args.out, MODEL, args.overwrite, "--out", {"--tokenizer": args.tokenizer})
    tokenizer = load_tokenizer(args.tokenizer)
    vocab = len(tokenizer)
    torch.manual_seed(args.seed)
    from safetensors.torch import save_file
    from transformers import AutoConfig

    ids = {"bos_token_id": tokenizer.eos_token_id, "eos_token_id": tokenizer.eos_token_id}
    # a config keeps the keys it does not know (random_weights, torch_dtype) as attributes
    if args.shape in SHAPES:
        fields = SHAPES[args.shape] | {"vocab_size": vocab}
        config = AutoConfig.for_model(**fields, **ids, random_weights=True, torch_dtype=args.dtype)
        weights = random_checkpoint(fields, getattr(torch, args.dtype))
    else:
        fields, weights = random_weights(args.n_layer, args.n_embd, vocab, dtype=getattr(torch, args.dtype))
        config = AutoConfig.for_model("gpt2", **fields, **ids, architectures=["GPT2LMHeadModel"], random_weights=True,
                                      torch_dtype=args.dtype)
        weights = {f"transformer.{name}": w for name, w in weights.items()}
    parameters = sum(w.numel() for w in weights.values())
    print(f"{args.shape}: {args.n_layer} layers x {args.n_embd}, vocabulary {vocab} (the tokenizer's), "
          f"{parameters / 1e6:.0f}M parameters, random weights in {args.dtype} -> {args.out}")
    with atomic_output(args.out, MODEL, args.overwrite) as tmp:
        tmp.mkdir()
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_file({name: w.contiguous() for name, w in weights.items()}, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "README.md").write_text(README.format(shape=args.shape, n_layer=args.n_layer, n_embd=args.n_embd,
                                                     vocab=vocab, prog=PROG))
    return args.out


if __name__ == "__main__":
    main()
