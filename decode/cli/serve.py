"""Serve a decoder over HTTP as OpenAI's completions API, for editors, notebooks and agents.

    python -m decode.serve --run RUN                                   # http://127.0.0.1:8000/v1
    python -m decode.serve --oracle DIR --draft DIR --ngram DIR --method staged --port 8080 --api-key KEY

Up to --max-batch requests decode at once, each step scoring all their trees in one oracle forward, each request's
output what it gets alone; the rest wait in a bounded queue. SIGTERM or Ctrl-C finishes the requests being decoded,
refuses the others and exits. Endpoints: POST /v1/completions,
GET /v1/models, GET /health (and POST /v1/chat/completions, which answers 400: chat is not served).
"""
import argparse
import logging
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from decode.api import SpeculativeDecoder
from decode.cli.flags import add_decoder_flags, check_ranges, decoder_flags
from decode.cli.help import HelpFormatter
from decode.errors import InputError, exits_on_input_error
from decode.methods import METHODS
from decode.plan_file import planned_loads
from decode.planning.concurrency import KEPT_SPEED, fitting_batch
from decode.planning.costs import measured_costs
from decode.sampling import Sampling
from decode.serving.app import create_app
from decode.serving.connections import protocol

PROG = "python -m decode.serve"


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    add_decoder_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="the port to listen on")
    p.add_argument("--api-key", help="require Authorization: Bearer KEY on every endpoint but /health")
    p.add_argument("--model-name", help="the model's name in answers and /v1/models (default: the oracle's hub name or "
                                        "directory name)")
    p.add_argument("--queue-size", type=int, default=16,
                   help="requests that may wait while --max-batch decode; more get 429")
    p.add_argument("--max-batch", type=int, metavar="N",
                   help="requests decoded at once, their trees scored in one oracle forward (default: the most that one "
                        f"forward scores while each keeps {KEPT_SPEED * 100:.0f}%% of its speed alone, by the oracle's "
                        "measured "
                        "forward costs; 1 where its forwards cannot run together)"),
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    p.add_argument("--read-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a connection whose request headers are not complete this long after it opens (or after the "
                        "last answer) is closed; a body not complete this long after the headers gets 408")
    args = p.parse_args(argv)
    check_ranges(p, [("--port", args.port, 0, 65535), ("--queue-size", args.queue_size, 1, None),
                     ("--max-body-bytes", args.max_body_bytes, 1, None), ("--max-batch", args.max_batch, 1, 256)])
    if not 0 < args.read_timeout < float("inf"):
        p.error(f"--read-timeout must be a positive number of seconds (got {args.read_timeout})")
    # the name answers carry: a hub name as typed, else the directory's
    given = Path(args.oracle) if args.oracle else args.run and args.run / "oracle"
    args.oracle_name = given.resolve().name if given is not None and given.is_dir() else str(given)
    flags = decoder_flags(p, args, Sampling())
    args.options = flags.options()
    args.plans = flags  # a request's setting: its own plan, or its own default
    return args


def check_address(host: str, port: int) -> None:
    """Refuse, before the models load, an address this process cannot listen on."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as err:
        raise InputError(f"cannot listen on {host}:{port} ({err.strerror or err}); pass another --port or --host") from None


def batch_size(decoder: SpeculativeDecoder) -> tuple[int, str]:
    """The requests to decode at once by default, and why."""
    options, oracle = decoder.options, decoder.decoder.oracle
    if not oracle.runs_together:
        return 1, "the oracle's forwards run one at a time here"
    rows = METHODS[options.method].rows(options)
    print("sizing the batch by the oracle's forward costs (measured once, then cached)", file=sys.stderr, flush=True)
    costs, _ = measured_costs(options.oracle, oracle, options.dtype)
    return fitting_batch(costs, rows), f"the most whose {rows}-node steps keep {KEPT_SPEED:.0%} of their speed alone"


def load_levels(plan: Path | None, max_batch: int) -> str:
    """Whether a greedy request's policy follows the number of requests in flight, in words (for the start line)."""
    loads = [n for n in planned_loads(plan) if n <= max_batch]
    if plan is None or max_batch == 1:
        return ""
    if len(loads) < 2:
        return (f"; one policy at any load (decode.plan --concurrency 1,{max_batch} plans one per number of requests "
                f"in flight)")
    return f"; greedy requests take the plan's policies for {', '.join(map(str, loads[:-1]))} and {loads[-1]} in flight"


@exits_on_input_error
def main(argv=None) -> None:
    import uvicorn

    args = parse(argv)
    args.plans.check_plans()  # a damaged plan of any setting is refused now, not at every request of its setting
    check_address(args.host, args.port)
    notes = logging.getLogger("decode")  # which plan each request's sampling setting decodes with, on stderr
    notes.setLevel(logging.INFO)
    if not notes.handlers:
        notes.addHandler(logging.StreamHandler())
    decoder = SpeculativeDecoder(args.options, args.plans)
    name = args.model_name or args.oracle_name
    max_batch, sized = (args.max_batch, "--max-batch") if args.max_batch else batch_size(decoder)
    app = create_app(decoder, name, args.api_key, args.queue_size, args.max_body_bytes, args.read_timeout, max_batch)
    worker = app.state.worker
    cache_bytes = worker.batch.reserve(decoder.decoder, max_batch)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                                           http=protocol(args.read_timeout)))
    http = threading.Thread(target=server.run, name="http", daemon=True)  # the decoder keeps the main thread

    def drain(signum, frame):  # SIGTERM, Ctrl-C: refuse what waits, finish what decodes, then exit 0
        worker.draining = True
        server.should_exit = True

    signal.signal(signal.SIGTERM, drain)
    signal.signal(signal.SIGINT, drain)
    http.start()
    while not server.started:
        if not http.is_alive():
            raise InputError(f"the HTTP server on {args.host}:{args.port} did not start; see the lines above")
        time.sleep(0.05)
    print(f"serving {name} ({args.options.method}, {args.options.dtype}) at http://{args.host}:{args.port}/v1, up to "
          f"{max_batch} requests at once ({sized}; their caches {cache_bytes / 2**20:,.0f} MiB, made at start) and "
          f"{args.queue_size} waiting (--queue-size){load_levels(args.options.plan, max_batch)}", file=sys.stderr,
          flush=True)
    worker.run()  # until the app shuts down
    http.join()


if __name__ == "__main__":
    main()
