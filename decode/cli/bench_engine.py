"""How fast is the lean engine? Six measurements, printed as tables:

1. per-token latency of greedy decoding: our baseline loop vs transformers `generate`, same checkpoint;
2. the cost of one forward over q = 1, 2, 4, ..., 64 new nodes after a cached prefix, for a model
   directory and for models of other shapes with random weights (--shape; cost does not depend on them);
3. for the model directory, the same forwards with the nodes as a tree and its explicit attention
   mask, against the chain: what a tree's mask costs;
4. for the model directory, the chain's forwards with all its matrices in each layout this device runs
   (decode.models.engine.LAYOUTS), against the engine's own choice (per matrix shape, timed at start-up);
5. on a GPU, our decoding and the forwards of 2 again with CUDA graphs (decode.models.cuda_graphs), and with
   --compile-layers a third time, each layer inside the graphs compiled by torch.compile;
6. what a forward costs the host work after it: a fixed piece of Python and numpy, of the kind a decoding
   step runs between forwards, right after a q=1 forward of the model directory and again right after itself;
7. the forward's cost curve c(q)/c(1) after 128 and 480 cached positions, for both models, beside this machine's
   measured memory bandwidth and peak multiply-add rate, the roofline curve they imply and the forward's share of
   it at every q (the roofline's time over the measured one), with torch's forward for comparison.

    python -m decode.bench_engine --model RUN/oracle --prompts RUN/prompts.jsonl
    python -m decode.bench_engine --model RUN/oracle --prompts RUN/prompts.jsonl --shape 6,512,8192 --shape gpt2-large
"""
import argparse
import datetime
import shlex
import time
from pathlib import Path

import torch

from decode.atomic import FILE, check_output, write_json
from decode.benchmarking.result_markdown import REPLAYED
from decode.benchmarking.tables import curve_rows, table_row
from decode.cli.help import HelpFormatter
from decode.devices import check_compiler, check_device, device_name, machine_name
from decode.errors import InputError, exits_on_input_error
from decode.loop import baseline
from decode.models.engine import dequantized_checkpoint
from decode.models.lean_engine import LeanEngine
from decode.models.llama import SHAPES
from decode.models.loading import lean_engine_class, lean_engine_of
from decode.models.model_config import read_config
from decode.models.precision import auto_dtype
from decode.models.pretrained import load_safetensors, model_dir
from decode.models.projection import LAYOUTS, onednn_packs
from decode.models.quantized import format_name, format_of
from decode.models.runtime import TORCH, CudaRuntime
from decode.planning.costs import PROJECTIONS, projection_shape, random_model
from decode.planning.roofline import ForwardShape, Machine, knee, measure_machine
from decode.prompts import load_prompts
from decode.provenance import command_line, provenance
from decode.sampling import Sampling
from decode.timing.forwards import NODE_COUNTS, forward_costs, host_work_after_forward
from decode.tokenizer import load_tokenizer, start_ids, text_ids


def encoded(tokenizer, prompts: list[str], device) -> list[torch.Tensor]:
    start = start_ids(tokenizer)
    return [torch.tensor(text_ids(tokenizer, text, start), device=device) for text in prompts]


def greedy(engine: LeanEngine, ids: torch.Tensor, new_tokens: int) -> tuple[list[int], float]:
    """Our greedy decoding of one prompt and its seconds (the loop reads every token on the host: nothing is
    left queued)."""
    start = time.perf_counter()
    tokens = baseline(engine, ids, new_tokens, Sampling(), stop_ids=()).tokens
    return tokens, time.perf_counter() - start


def generation_latency(model_dir, prompts: list[str], new_tokens: int, dtype: str, device: str
                       ) -> tuple[dict, list[list[int]]]:
    """Milliseconds per generated token, ours vs transformers generate (greedy, prompt by prompt; a quantized model's
    weights dequantized for transformers), whether they agree, and our outputs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    engine = lean_engine_of(model_dir).load(model_dir, dtype, device)
    fmt = format_of(read_config(model_dir), model_dir)
    if fmt is None:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=engine.dtype)
    else:  # transformers' GPT-2 over the dequantized weights: the same model, its weights read at 16 or 32 bits
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=engine.dtype)
        hf.transformer.load_state_dict(dequantized_checkpoint(load_safetensors(model_dir), fmt, model_dir))
    hf = hf.to(engine.device).eval()  # type: ignore[arg-type]  # transformers' decorator hides Module.to
    tokenizer = load_tokenizer(model_dir)
    ours_s = hf_s = 0.0
    ours_n = hf_n = agree = 0
    outputs = []
    for ids in encoded(tokenizer, prompts, engine.device):
        tokens, seconds = greedy(engine, ids, new_tokens)
        outputs.append(tokens)
        ours_s, ours_n = ours_s + seconds, ours_n + len(tokens)
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids[None], max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=tokenizer.eos_token_id)[0, ids.numel():].tolist()
        hf_s += time.perf_counter() - start
        hf_n += len(out)
        agree += out == tokens
    return {"ours_ms_per_token": 1e3 * ours_s / ours_n, "hf_generate_ms_per_token": 1e3 * hf_s / hf_n,
            "speedup": (hf_s / hf_n) / (ours_s / ours_n), "identical_outputs": f"{agree}/{len(prompts)}"}, outputs


def with_cuda_graphs(args, texts: list[str], latency: dict, outputs: list[list[int]], costs: dict,
                     compile_layers: bool = False) -> dict:
    """Greedy decoding and the forward costs again with each forward replayed as a CUDA graph (its layers compiled
    by torch.compile with `compile_layers`), against launching every kernel on its own (the first two tables)."""
    engine = lean_engine_of(args.model).load(args.model, args.dtype, args.device, cuda_graphs=True,
                                             compile_layers=compile_layers)
    prompts = encoded(load_tokenizer(args.model), texts, engine.device)
    greedy(engine, prompts[0], args.max_new_tokens)  # untimed: its first forwards capture graphs (and compile)
    runs = [greedy(engine, ids, args.max_new_tokens) for ids in prompts]
    ms_per_token = 1e3 * sum(seconds for _, seconds in runs) / sum(len(tokens) for tokens, _ in runs)
    same = sum(tokens == before for (tokens, _), before in zip(runs, outputs))
    key, short = ("compiled_layers", "compiled") if compile_layers else ("cuda_graphs", "graphs")
    way = REPLAYED[key]
    print(f"\n{way}: ours {ms_per_token:.2f} ms/token (without {latency['ours_ms_per_token']:.2f}: "
          f"{latency['ours_ms_per_token'] / ms_per_token:.2f}x), outputs identical to those without: {same}/{len(texts)}")
    models = {args.model: engine} | shaped_models(args, cuda_graphs=True, compile_layers=compile_layers)
    graphed = {name: forward_costs(model, args.prefix, args.repeats) for name, model in models.items()}
    for name, row in graphed.items():
        print(table_row(name, row))
        print(table_row(f"  with {short} / without", {q: ms / costs[name][q] for q, ms in row.items()}))
    return {f"generation_with_{key}": {"ours_ms_per_token": ms_per_token, "identical_to_without": f"{same}/{len(texts)}"},
            f"forward_ms_with_{key}": graphed}


PROG = "python -m decode.bench_engine"
CURVE_PREFIXES = (128, 480)  # cached positions: a prompt's, and a long context's


def roofline_tables(args, models: dict) -> dict:
    """Measurement 7: each model's forward costs after CURVE_PREFIXES cached positions, as the engine runs them and in
    torch's operations, against the roofline of this machine: its bandwidth and peak measured before the curves and
    after them, the faster of each kept (a shared machine's speed drifts while the curves run)."""
    before = measure_machine(models[args.model].dtype)
    measured = {}
    for name, model in models.items():
        for prefix in CURVE_PREFIXES:
            measured[name, prefix] = ms = {"engine": forward_costs(model, prefix, args.repeats)}
            if model.runtime.rows:
                with model.runtime.forced(TORCH):
                    ms["torch"] = forward_costs(model, prefix, args.repeats)
    after = measure_machine(models[args.model].dtype)
    machine = Machine(max(before.bandwidth, after.bandwidth), max(before.macs, after.macs),
                      (before if before.macs >= after.macs else after).peak_dtype)
    print(f"\nthis machine: memory read {machine.bandwidth / 1e9:.1f} GB/s (sums over 256 MB), peak "
          f"{machine.macs / 1e9:.1f} GMAC/s ({machine.peak_dtype} square products in torch), "
          f"{torch.get_num_threads()} threads (the faster of before and after the curves)")
    curves: dict[str, dict] = {}
    result = {"bandwidth_gb_s": machine.bandwidth / 1e9, "peak_gmac_s": machine.macs / 1e9,
              "peak_dtype": machine.peak_dtype, "curves": curves}
    for (name, prefix), ms in measured.items():
        model, shape = models[name], ForwardShape.of(models[name])
        roof = {q: shape.roofline_ms(machine, q, prefix) for q in NODE_COUNTS}
        print(f"\n{name}: c(q)/c(1) after {prefix} cached positions (the engine: the C++ call up to "
              f"{model.runtime.rows} rows; the roofline's knee at {knee(shape, machine, prefix)} rows)")
        curves[f"{name} @ {prefix}"] = curve = {"ms": ms, "roofline_ms": roof}
        print(f"{'':<40}" + "".join(f"{q:>8}" for q in NODE_COUNTS))
        for label, row in curve_rows(curve):
            print(table_row(label, row))
    return result


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help="a GPT-2 or Llama-family checkpoint: a directory (e.g. RUN/oracle) or "
                                                  "a hub name")
    p.add_argument("--prompts", required=True, help="a .jsonl[.gz] prompt file or 'humaneval'")
    p.add_argument("--limit", type=int, default=5, help="the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt")
    p.add_argument("--prefix", type=int, default=128, help="cached positions before the timed forward")
    p.add_argument("--repeats", type=int, default=20, help="timed forwards per node count")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="auto: the one the model's forward measures faster in here (a GPU: bfloat16)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N for the N-th GPU)")
    p.add_argument("--shape", action="append", metavar="SHAPE",
                   help="also time a model of this shape with random weights, for cost only: a GPT-2 name "
                        f"({', '.join(PROJECTIONS)}), n_layer,n_embd,vocab (e.g. 6,512,8192) or a Llama-family "
                        f"name ({', '.join(SHAPES)}); repeatable (default: gpt2-large)")
    p.add_argument("--compile-layers", action="store_true",
                   help="on a GPU, time measurement 5 again with each layer compiled (torch.compile; tens of seconds "
                        "of compiling first)")
    p.add_argument("--skip-large", action="store_true", help="time no random-weight shape (overrides --shape)")
    p.add_argument("--out", type=Path, help="write the figures as JSON here")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = p.parse_args(argv)
    args.model = str(model_dir(args.model, "--model"))
    engine, why_not = lean_engine_class(read_config(args.model))
    if engine is None:
        bench = shlex.join(["python", "-m", "decode.bench", "--oracle", args.model, "--prompts", args.prompts,
                            "--backend", "hf", "--methods", "baseline,hf-generate"])
        raise InputError(f"{args.model} is a model the lean engine this command measures does not run ({why_not}); "
                         f"`{bench}` times decoding it with transformers")
    if args.limit < 1 or args.max_new_tokens < 1 or args.repeats < 1 or args.prefix < 0:
        p.error("--limit, --max-new-tokens and --repeats must be at least 1, --prefix 0 or more")
    if args.out:
        prompts = Path(args.prompts) if args.prompts != "humaneval" else None
        check_output(args.out, FILE, args.overwrite, "--out", {"model": args.model, "prompts": prompts})
    args.shapes = [] if args.skip_large else args.shape or ["gpt2-large"]
    for spec in args.shapes:
        if spec not in SHAPES:
            projection_shape(spec, "--shape")  # refused here, in one line, before anything runs
    check_device(args.device)
    check_compiler(args.device, ["--compile-layers"] if args.compile_layers else [], "leave out --compile-layers")
    if args.dtype == "auto":
        args.dtype, why = auto_dtype(args.device, None, args.model)
        print(f"dtype: {args.dtype} ({why}; --dtype float32 or bfloat16 to choose)")
    return args


def shaped_models(args, cuda_graphs: bool = False, compile_layers: bool = False) -> dict:
    """The --shape models, random weights in the run's dtype, by a label that says so."""
    return {f"{spec}-shaped (random weights)": random_model(spec, args.dtype, args.device, cuda_graphs, compile_layers)
            for spec in args.shapes}


def forward_tables(args, models: dict) -> dict:
    """Measurements 2-4: the forward's cost by node count (the model, and the --shape models), as a tree against a
    chain, and by weight layout."""
    engine = models[args.model]
    costs = {name: forward_costs(model, args.prefix, args.repeats) for name, model in models.items()}
    print(f"\nforward cost in ms after {args.prefix} cached positions, by new nodes q")
    print(f"{'model':<40}" + "".join(f"{q:>8}" for q in NODE_COUNTS))
    for name, row in costs.items():
        print(table_row(name, row) + f"   ({models[name].shape.n_layer} layers)")
    tree_costs = forward_costs(engine, args.prefix, args.repeats, tree=True)
    print(table_row("the same nodes as a tree, explicit mask", tree_costs))
    print(table_row("  tree / chain", {q: ms / costs[args.model][q] for q, ms in tree_costs.items()}))
    layouts = [name for name in LAYOUTS if name != "packed" or (args.device == "cpu" and onednn_packs(engine.dtype))]
    layout_costs = {name: forward_costs(lean_engine_of(args.model).load(args.model, args.dtype, args.device, layout=name),
                                        args.prefix, args.repeats) for name in layouts}
    print(f"\nthe chain's forward by weight layout (chosen per matrix: {', '.join(f'{k} {v}' for k, v in engine.layouts.items())})")
    for name, row in (layout_costs | {"chosen per matrix (first table)": costs[args.model]}).items():
        print(table_row(name, row))
    return {"forward_ms": costs, "tree_forward_ms": tree_costs, "layouts": engine.layouts,
            "forward_ms_by_layout": layout_costs}


@exits_on_input_error
def main(argv=None) -> dict:
    args = parse(argv)
    texts = [r["prompt"] for r in load_prompts(args.prompts, args.limit)]
    latency, outputs = generation_latency(args.model, texts, args.max_new_tokens, args.dtype, args.device)
    print(f"greedy decoding, {len(texts)} prompts x {args.max_new_tokens} tokens ({args.dtype}, {device_name(torch.device(args.device))})")
    print(f"  ours (lean engine)        {latency['ours_ms_per_token']:8.2f} ms/token")
    print(f"  transformers generate     {latency['hf_generate_ms_per_token']:8.2f} ms/token")
    print(f"  speedup {latency['speedup']:.2f}x, identical outputs {latency['identical_outputs']}")

    engine = lean_engine_of(args.model).load(args.model, args.dtype, args.device, native_blocks=True)
    device = torch.device(args.device)
    quantization = engine.runtime.quantization
    result = {"generation": latency, "dtype": args.dtype, "weights": format_name(quantization),
              "device": device_name(device), "machine": machine_name(device), "threads": torch.get_num_threads(),
              "date": datetime.date.today().isoformat(), **provenance(),
              "command": command_line(PROG, argv)}
    models = {args.model: engine} | shaped_models(args)
    result |= forward_tables(args, models)
    if not isinstance(engine.runtime, CudaRuntime):
        result["roofline"] = roofline_tables(args, models)
    host = host_work_after_forward(engine, args.prefix, args.repeats)
    print(f"\nhost work between forwards (a 200-item Python loop, a 64-value numpy gather): {host['after a forward']:.1f} us "
          f"right after a q=1 forward, {host['again']:.1f} us again ({host['after a forward'] / host['again']:.1f}x)")
    result["host_work_us"] = host
    if isinstance(engine.runtime, CudaRuntime):
        for compile_layers in (False, True) if args.compile_layers else (False,):
            result |= with_cuda_graphs(args, texts, latency, outputs, result["forward_ms"], compile_layers)
    if args.out:
        write_json(args.out, result, args.overwrite)
    return result


if __name__ == "__main__":
    main()
