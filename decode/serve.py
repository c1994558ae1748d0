"""Serve a decoder over HTTP as OpenAI's completions API, for editors, notebooks and agents.

    python -m decode.serve --run RUN                                   # http://127.0.0.1:8000/v1
    python -m decode.serve --oracle DIR --draft DIR --ngram DIR --method staged --port 8080 --api-key KEY

One decoder serves the requests in turn (batch one is the design); the rest wait in a bounded queue. SIGTERM or
Ctrl-C finishes the request being decoded, refuses the others and exits. Endpoints: POST /v1/completions,
GET /v1/models, GET /health.
"""
import argparse
import signal
import sys

from data.cli import HelpFormatter
from data.errors import exits_on_input_error
from decode.api import SpeculativeDecoder
from decode.run import add_decoder_flags, decoder_options
from decode.server import create_app

PROG = "python -m decode.serve"


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    add_decoder_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="the port to listen on")
    p.add_argument("--api-key", help="require Authorization: Bearer KEY on every endpoint but /health")
    p.add_argument("--model-name", help="the model's name in answers and /v1/models (default: the oracle directory's)")
    p.add_argument("--queue-size", type=int, default=16, help="requests that may wait for the decoder; more get 429")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    args = p.parse_args(argv)
    if not 0 <= args.port < 65536 or args.queue_size < 1 or args.max_body_bytes < 1:
        p.error("need a --port in 0..65535, and a --queue-size and --max-body-bytes of at least 1")
    args.options = decoder_options(p, args)
    return args


@exits_on_input_error
def main(argv=None) -> None:
    import uvicorn

    args = parse(argv)
    decoder = SpeculativeDecoder(args.options)
    name = args.model_name or args.options.oracle.resolve().name
    app = create_app(decoder, name, args.api_key, args.queue_size, args.max_body_bytes)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGTERM, Ctrl-C: refuse what waits, finish what decodes, then exit
            app.state.worker.draining = True
            super().handle_exit(sig, frame)

    # uvicorn handles SIGTERM while it serves and raises it again once drained: a drained server exits 0
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    print(f"serving {name} ({args.options.method}, {args.options.dtype}) at http://{args.host}:{args.port}/v1",
          file=sys.stderr, flush=True)
    Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info")).run()


if __name__ == "__main__":
    main()
