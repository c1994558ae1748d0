"""How fast for many users at once? Aggregate and per-request speed as more clients decode at the same time.

    python -m decode.load --run RUN --concurrency 1,2,4,8 --limit 16 --max-new-tokens 64 --out load.json --plot load.png

At each level that many clients send the held-out prompts (--limit of them), each sending its next prompt as its last
completion ends. Ours decode them as decode.serve does, every request in flight verified in one oracle forward, with
--method (default staged) and the run's plan. The peers run on the oracle (and the draft) exported to GGUF, on as
many threads, through llama-server with a slot per client (-np N): `llamacpp-server` (its plain decoding) and
`llamacpp-draft` (its draft-model speculation, the fastest --spec-draft-n-max of 2, 4 and 8 at each level); without
the binary (on PATH, or LLAMA_SERVER) they are skipped with a note. Per level and engine: aggregate tokens/s, the
median request's tokens/s, and the time to first token (50th and 95th percentile).
"""
import argparse
import datetime
import tempfile
from pathlib import Path

import torch

from decode.api import SpeculativeDecoder
from decode.atomic import FILE, check_output, write_json
from decode.benchmarking import load
from decode.benchmarking.llama_server import LlamaServer, export_gguf, missing_reason, sampler, server_binary, server_build
from decode.benchmarking.plots import check_plot_path, pyplot, save
from decode.cli.help import HelpFormatter
from decode.cli.settings import Settings, add_result_flags, encode_prompts, parse_settings
from decode.devices import machine_name
from decode.errors import exits_on_input_error
from decode.models.quantized import format_name
from decode.provenance import command_line, provenance

PROG = "python -m decode.load"
PEERS: dict[str, list[list[str]]] = {"llamacpp-server": [[]],
         "llamacpp-draft": [["--spec-type", "draft-simple", "--spec-draft-n-max", str(n)] for n in (2, 4, 8)]}


def parse(argv) -> tuple[argparse.Namespace, Settings]:
    """load's own flags, checked, and decode.run's, parsed."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter,
                                epilog="Every other flag is decode.run's (--run, --prompts, --limit, --max-new-tokens, "
                                       "--method, --temperature, --dtype, ...).")
    p.add_argument("--concurrency", default="1,2,4", help="comma-separated numbers of clients at once")
    p.add_argument("--peers", help=f"comma-separated, from {', '.join(PEERS)}, or 'none' (default: both where "
                                   f"llama-server is found)")
    add_result_flags(p, "the figures", "aggregate tokens/s against clients")
    known, rest = p.parse_known_args(argv)
    try:
        known.levels = sorted({int(n) for n in known.concurrency.split(",")})
    except ValueError:
        p.error(f"--concurrency takes comma-separated numbers of clients (got {known.concurrency!r})")
    if known.levels[0] < 1 or known.levels[-1] > 64:
        p.error(f"--concurrency {known.concurrency}: use 1 to 64 clients a level")
    names = [] if known.peers == "none" else (known.peers or ",".join(PEERS)).split(",")
    if unknown := [n for n in names if n not in PEERS]:
        p.error(f"unknown peers {unknown}; choose from {', '.join(PEERS)}, or none")
    if names and server_binary() is None:
        if known.peers:
            p.error(f"{', '.join(names)}: {missing_reason()}")
        print(f"skipping {', '.join(names)}: {missing_reason()}")
        names = []
    known.names = names
    settings = parse_settings(["--method", "staged", *rest], PROG, __doc__.split("\n\n")[0], records=False)
    if known.out:
        check_output(known.out, FILE, known.overwrite, "--out", settings.reads())
    if known.plot:
        check_plot_path(known.plot, known.overwrite, settings.reads())
    return known, settings


def peer_rows(name: str, settings: Settings, prompts: list[list[int]], levels: list[int], context: int,
              draft_format: str | None) -> list[dict]:
    """A peer's figures at each level: llama-server with a slot per client, at the fastest of its candidate flags; its
    draft in `draft_format`'s blocks where ours was quantized to it."""
    base, rows = settings.flags.base, []
    with tempfile.TemporaryDirectory(prefix="llamacpp-gguf-") as folder:
        models = export_gguf(base.oracle, base.draft if name == "llamacpp-draft" else None, Path(folder), base.dtype,
                             draft_format)
        for clients in levels:
            best: dict = {"aggregate_tokens_per_s": -1.0}
            for flags in PEERS[name]:
                server = LlamaServer(models, flags, torch.get_num_threads(), context, slots=clients)
                try:
                    server.stream({"prompt": prompts[0], "n_predict": 8, **sampler(settings.sampling)})  # warm-up
                    figures = load.summary(*load.llama_server(server, prompts, clients, settings.max_new_tokens,
                                                              sampler(settings.sampling)))
                finally:
                    server.close()
                if figures["aggregate_tokens_per_s"] > best["aggregate_tokens_per_s"]:
                    best = figures | {"flags": " ".join(flags)}
            rows.append({"engine": name, "clients": clients, **best})
            print(row_line(rows[-1]), flush=True)
    return rows


def row_line(row: dict) -> str:
    return (f"{row['engine']:<24} {row['clients']:>7} {row['aggregate_tokens_per_s']:>15.1f} "
            f"{row['request_tokens_per_s']:>17.1f} {row['first_token_p50_s']:>14.3f} {row['first_token_p95_s']:>14.3f}"
            + (f"  {row['flags']}" if row.get("flags") else ""))


def plot(rows: list[dict], path: Path, title: str, overwrite: bool) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for engine in dict.fromkeys(row["engine"] for row in rows):
        mine = [row for row in rows if row["engine"] == engine]
        ax.plot([r["clients"] for r in mine], [r["aggregate_tokens_per_s"] for r in mine], marker="o", label=engine)
    ax.set_xlabel("clients at once")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    save(fig, path, overwrite)


@exits_on_input_error
def main(argv=None) -> dict:
    known, settings = parse(argv)
    decoder = SpeculativeDecoder(settings.options, settings.flags)
    encoded = encode_prompts(settings, [decoder])  # each checked to fit the context
    prompts = [decoder.token_ids(record["prompt"]) for record, _ in encoded]
    context = min(decoder.decoder.context(), max(map(len, prompts)) + settings.max_new_tokens + 16)
    method = f"ours ({settings.options.method})"
    print(f"{len(prompts)} prompts x {settings.max_new_tokens} new tokens, {settings.sampling.describe()}, "
          f"{settings.options.dtype}, clients {', '.join(map(str, known.levels))}; engines: {method}"
          + "".join(f", {name}" for name in known.names))
    print(f"{'engine':<24} {'clients':>7} {'aggregate tok/s':>15} {'request tok/s p50':>17} {'first token p50':>14} "
          f"{'first token p95':>14}")
    batch_bytes = decoder.batch.reserve(decoder.decoder, known.levels[-1])  # the forks, made before any timing
    decoder.generate(prompts[0], max_new_tokens=8)  # warm-up
    rows = []
    for clients in known.levels:
        served, seconds = load.ours(decoder, prompts, clients, settings.max_new_tokens, settings.sampling_arguments())
        rows.append({"engine": method, "clients": clients, **load.summary(served, seconds)})
        print(row_line(rows[-1]), flush=True)
    draft = decoder.decoder.draft
    draft_format = format_name(draft.runtime.quantization) if draft is not None else None
    for name in known.names:
        rows += peer_rows(name, settings, prompts, known.levels, context, draft_format)
    result = {"settings": {"command": command_line(PROG, argv),
                           "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
                           "machine": machine_name(decoder.decoder.oracle.device), "threads": torch.get_num_threads(), "prompts": len(prompts),
                           "max_new_tokens": settings.max_new_tokens, "sampling": settings.sampling.describe(),
                           "dtype": settings.options.dtype, "cache_bytes": batch_bytes, **provenance(),
                           **({"llama_server": server_build(server_binary() or "")} if known.names else {})},
              "levels": rows}
    if known.out:
        write_json(known.out, result, known.overwrite)
        print(f"wrote {known.out}")
    if known.plot:
        plot(rows, known.plot, f"{len(prompts)} prompts x {settings.max_new_tokens} tokens, {machine_name(decoder.decoder.oracle.device)}",
             known.overwrite)
        print(f"wrote {known.plot}")
    return result


if __name__ == "__main__":
    main()
