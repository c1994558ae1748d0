"""Many clients at once: `clients` streams of requests, each sending its next prompt as its last completion ends,
until every prompt is served. Ours decode as a server's worker does (decode.batch: one oracle forward for every
request in flight); llama-server with as many slots (`-np`) gets one HTTP stream per client. Each request's tokens,
seconds and time to its first token are kept; `summary` gives the aggregate tokens/s, the median request's tokens/s
and the times to first token's 50th and 95th percentiles."""
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from decode.api import SpeculativeDecoder
from decode.benchmarking.llama_server import LlamaServer
from decode.generation import Stream


@dataclass
class Flight:
    stream: Stream
    began: float
    first: float | None = None  # seconds to its first piece, once it came


@dataclass
class Served:
    tokens: int
    seconds: float  # from the request's start to its last token
    first: float  # from its start to its first token


def ours(decoder: SpeculativeDecoder, prompts: list[list[int]], clients: int, max_new_tokens: int,
         settings: dict) -> tuple[list[Served], float]:
    """Every prompt decoded by `clients` clients at once through one batch; the requests and the wall seconds."""
    waiting, served, flights = deque(enumerate(prompts)), list[Served](), list[Flight]()

    def begin() -> None:
        i, prompt = waiting.popleft()
        stream = decoder.stream_in(decoder.batch, prompt, max_new_tokens=max_new_tokens, **settings, seed=i)
        flights.append(Flight(stream, time.perf_counter()))

    start = time.perf_counter()
    for _ in range(min(clients, len(waiting))):
        begin()
    while flights:
        for flight in list(flights):
            piece = next(flight.stream, None)
            now = time.perf_counter()
            if flight.first is None:
                flight.first = now - flight.began
            if piece is not None:
                continue
            assert flight.stream.result is not None  # the stream has ended
            served.append(Served(len(flight.stream.result.token_ids), now - flight.began, flight.first))
            flights.remove(flight)
            if waiting:
                begin()
    return served, time.perf_counter() - start


def llama_server(server: LlamaServer, prompts: list[list[int]], clients: int, max_new_tokens: int,
                 sampler: dict) -> tuple[list[Served], float]:
    """Every prompt sent to llama-server by `clients` threads at once, each streaming its completion."""
    waiting, served, lock = deque(enumerate(prompts)), [], threading.Lock()
    failures: list[Exception] = []

    def client() -> None:
        while True:
            with lock:
                if not waiting:
                    return
                i, prompt = waiting.popleft()
            began = time.perf_counter()
            try:
                tokens, first = server.stream({"prompt": prompt, "n_predict": max_new_tokens, "seed": i,
                                               "cache_prompt": False, **sampler})
            except Exception as err:  # raised below, once every client has stopped
                failures.append(err)
                return
            with lock:
                served.append(Served(tokens, time.perf_counter() - began, first))

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return served, time.perf_counter() - start


def summary(served: list[Served], seconds: float) -> dict:
    firsts = [s.first for s in served]
    return {"requests": len(served), "tokens": sum(s.tokens for s in served), "seconds": seconds,
            "aggregate_tokens_per_s": sum(s.tokens for s in served) / seconds,
            "request_tokens_per_s": statistics.median(s.tokens / s.seconds for s in served),
            "first_token_p50_s": float(np.percentile(firsts, 50)), "first_token_p95_s": float(np.percentile(firsts, 95))}
