"""OpenAI's completions API over one SpeculativeDecoder (FastAPI; decode.serve runs it).

    POST /v1/completions        prompt, max_tokens, temperature, top_p, top_k, stop, seed, stream (server-sent events)
    GET  /v1/models             the one model served
    GET  /health                status, queue length, requests completed and cancelled (no API key needed)
    POST /v1/chat/completions   400: chat (messages) is not served; the error names /v1/completions

One decoder decodes one request at a time, as batch one is the design: requests wait in a bounded queue (a full
queue answers 429) and the worker takes them in turn, on the process's main thread (torch's OpenMP products ran at
half speed on another thread here) while the HTTP server runs on its own. A streaming client that disconnects stops its own
decoding at the next step. Responses carry `usage` and, under `decoding`, the method, oracle calls, tokens per
oracle call and seconds. Every refusal, an unknown route or method included, is a 4xx with OpenAI's error object
naming the field at fault; only a fault inside decoding is a 5xx, in the same shape, its traceback logged.
"""
import asyncio
import hmac
import json
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from decode.api import SpeculativeDecoder
from decode.errors import InputError
from decode.serving.request import SCHEMA, Completion, RequestError, parse_completion

log = logging.getLogger("decode.serve")
DISCONNECT_CHECK = 0.5  # seconds between a non-streaming request's checks that its client is still there
ROUTES = "POST /v1/completions, GET /v1/models, GET /health"

@dataclass
class Job:
    """A completion in the queue or being decoded, and how its events reach the request that waits for it."""

    completion: Completion
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, kind: str, value=None) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class StopText:
    """OpenAI's stop sequences on streamed text: the text before the first stop string, with the tail that could
    still begin one held back until it cannot. Each piece costs time in its own length and the stop strings' only:
    a new match ends in the new piece, so the search starts len(stop) - 1 characters before it, and the tail held
    back is found by Knuth, Morris and Pratt's automaton over the text's last len(stop) - 1 characters."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.text, self.shown, self.stopped = stops, "", 0, False
        self.longest = max((len(s) for s in stops), default=0)
        self.borders = [borders(s) for s in stops]

    def feed(self, piece: str) -> str:
        """The newly visible text after `piece`."""
        start = max(0, len(self.text) - self.longest + 1)  # where a match that ends in `piece` can begin
        self.text += piece
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if found:
            end, self.stopped = min(found), True
        else:
            end = len(self.text) - max((self.begun(s, b) for s, b in zip(self.stops, self.borders)), default=0)
        new, self.shown = self.text[self.shown : max(end, self.shown)], max(end, self.shown)
        return new

    def begun(self, stop: str, border: list[int]) -> int:
        """The length of the longest proper prefix of `stop` that the text ends with."""
        state = 0
        for c in self.text[max(0, len(self.text) - len(stop) + 1) :]:
            while state and stop[state] != c:
                state = border[state - 1]
            state += stop[state] == c
        return state

    def flush(self) -> str:
        """The held-back tail, once the text is complete and no stop string came."""
        if self.stopped:
            return ""
        new, self.shown = self.text[self.shown :], len(self.text)
        return new


def borders(stop: str) -> list[int]:
    """Knuth, Morris and Pratt's prefix function: for each i, the longest proper prefix of stop[: i + 1] that is also
    its suffix."""
    border = [0] * len(stop)
    for i in range(1, len(stop)):
        k = border[i - 1]
        while k and stop[i] != stop[k]:
            k = border[k - 1]
        border[i] = k + (stop[i] == stop[k])
    return border


class Worker:
    """What decodes: takes jobs from a bounded queue in turn, in `run`, until `stop`."""

    def __init__(self, decoder: SpeculativeDecoder, queue_size: int):
        self.decoder, self.jobs = decoder, queue.Queue[Job | None](maxsize=queue_size)
        self.decoding, self.draining = False, False
        self.completed = self.cancelled = 0

    def submit(self, job: Job) -> None:
        if self.draining:
            raise RequestError(503, "the server is shutting down", kind="server_error")
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise RequestError(429, f"the server is busy: {self.jobs.maxsize} requests are waiting for the decoder; retry "
                                    f"later", kind="rate_limit_error", code="rate_limit_exceeded") from None

    def run(self) -> None:
        while (job := self.next_job()) is not None:
            if self.draining or job.cancelled.is_set():
                self.cancelled += job.cancelled.is_set()
                job.emit("error", RequestError(503, "the server is shutting down", kind="server_error"))
                continue
            self.decoding = True
            try:
                self.decode(job)
            except Exception as err:  # a job's failure is its own; the worker serves the next
                if not isinstance(err, (InputError, RequestError)):
                    log.exception("decoding failed")
                job.emit("error", err)
            finally:
                self.decoding = False

    def next_job(self) -> Job | None:
        """The next job, waking twice a second meanwhile: signal handlers run on this thread only between waits (a
        wait that never wakes kept SIGTERM's handler from running under one kernel)."""
        while True:
            try:
                return self.jobs.get(timeout=0.5)
            except queue.Empty:
                continue

    def decode(self, job: Job) -> None:
        c = job.completion
        stream = self.decoder.stream(c.ids, max_new_tokens=c.max_tokens, **c.settings)
        text = StopText(c.stops)
        for piece in stream:
            if job.cancelled.is_set():  # the client went away: stop at this step, free the decoder
                stream.close()
                self.cancelled += 1
                return
            if new := text.feed(piece):
                job.emit("text", new)
        if tail := text.flush():
            job.emit("text", tail)
        self.completed += 1
        job.emit("done", stream.result)

    def stop(self) -> None:
        self.draining = True
        self.jobs.put(None)


def answer(err: RequestError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def create_app(decoder: SpeculativeDecoder, model: str, api_key: str | None = None, queue_size: int = 16,
               max_body_bytes: int = 1 << 20, read_timeout: float = 30.0) -> FastAPI:
    """The server's ASGI app over `decoder`, named `model` in its answers; `app.state.worker.run()` must decode its
    jobs (decode.serve runs it on the main thread), and returns once the app has shut down. A request body that takes
    over `read_timeout` seconds to arrive is answered 408."""
    worker = Worker(decoder, queue_size)
    left = RateLimitedNote("clients left before their request bodies arrived")

    async def lifespan(app: FastAPI):
        yield
        worker.stop()

    app = FastAPI(title="staged-speculative", lifespan=lifespan)
    app.state.worker = worker
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)

    @app.exception_handler(RequestError)
    async def refused(request: Request, err: RequestError):
        return answer(err)

    @app.exception_handler(InputError)
    async def input_refused(request: Request, err: InputError):  # a setting this server cannot decode with
        return answer(failure(err))

    @app.exception_handler(HTTPException)
    async def not_served(request: Request, err: HTTPException):  # routing's own: an unknown path or method
        what = {404: "is not an endpoint of this server", 405: "does not take this method"}.get(err.status_code)
        message = f"{request.method} {request.url.path} {what}; it serves {ROUTES}" if what else str(err.detail)
        return answer(RequestError(err.status_code, message))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError):
        return answer(RequestError(400, f"invalid request: {err.errors()[0]['msg']}"))

    @app.exception_handler(Exception)
    async def fault(request: Request, err: Exception):  # Starlette logs the traceback after this answer
        return answer(RequestError(500, f"the server failed: {type(err).__name__}", kind="server_error"))

    @app.get("/health")
    async def health():
        status = "draining" if worker.draining else "ok"
        return JSONResponse({"status": status, "queued": worker.jobs.qsize(), "decoding": worker.decoding,
                             "completed": worker.completed, "cancelled": worker.cancelled},
                            status_code=503 if worker.draining else 200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model", "created": int(time.time()),
                                            "owned_by": "staged-speculative"}]}

    @app.post("/v1/completions", openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": SCHEMA}}}})
    async def completions(request: Request):
        try:
            body = await asyncio.wait_for(read_body(request, max_body_bytes, left), read_timeout)
        except asyncio.TimeoutError:
            raise RequestError(408, f"the request body did not arrive within {read_timeout:g} seconds") from None
        completion = parse_completion(body, decoder)
        job = Job(completion, asyncio.get_running_loop())
        worker.submit(job)
        reply = Answer(job, model, decoder.options.method)
        if completion.stream:
            return StreamingResponse(reply.events(), media_type="text/event-stream")
        try:
            return await reply.whole(request)
        except asyncio.CancelledError:
            job.cancelled.set()
            raise

    @app.post("/v1/chat/completions")
    async def chat():
        raise RequestError(400, "this server serves OpenAI's completions API, not chat: POST /v1/completions with a "
                                "prompt (text or token ids) instead of messages", "messages")

    return app


class RateLimitedNote:
    """A log line for something that is not an error but may come often (a client leaving mid-request): at most one
    every `every` seconds, counting the times since the last."""

    def __init__(self, text: str, every: float = 60.0):
        self.text, self.every, self.count, self.last = text, every, 0, -float("inf")

    def __call__(self) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= self.every:
            log.info("%s (%d since the last note)", self.text, self.count)
            self.count, self.last = 0, now


async def read_body(request: Request, max_bytes: int, left: RateLimitedNote) -> bytes:
    """The request's body as it arrives; 413 once it is over `max_bytes` (a chunked body declares no length). A client
    that leaves before its body is in gets a 400 no one reads, and `left()` notes it."""
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_bytes:
                raise RequestError(413, f"the request body is over {max_bytes} bytes")
    except ClientDisconnect:
        left()
        raise RequestError(400, "the client left before its request body arrived") from None
    return bytes(body)


class Guard:
    """Plain ASGI middleware (it leaves streaming and disconnects alone): the API key on every path but /health,
    and a declared body size over the limit refused before it is read."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    def authorized(self, header: str | None) -> bool:
        """An Authorization header of the Bearer scheme (its name in any case, RFC 7235) with the key, compared in time
        that does not depend on where it differs."""
        scheme, _, key = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), (self.api_key or "").encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            refusal = None
            if self.api_key is not None and scope["path"] != "/health" and not self.authorized(headers.get("authorization")):
                refusal = RequestError(401, "a valid API key is required: send Authorization: Bearer KEY",
                                       kind="authentication_error", code="invalid_api_key")
            elif headers.get("content-length", "").isdigit() and int(headers["content-length"]) > self.max_body_bytes:
                refusal = RequestError(413, f"the request body is over {self.max_body_bytes} bytes")
            if refusal is not None:
                return await answer(refusal)(scope, receive, send)
        await self.app(scope, receive, send)


class Answer:
    """A job's events as OpenAI's completion object, whole or as server-sent chunks."""

    def __init__(self, job: Job, model: str, method: str):
        self.job, self.model, self.method = job, model, method
        self.id, self.created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def body(self, text: str, finish_reason: str | None, result=None) -> dict:
        body = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}]}
        if result is not None:
            prompt = len(self.job.completion.ids)
            body["usage"] = {"prompt_tokens": prompt, "completion_tokens": len(result.token_ids),
                             "total_tokens": prompt + len(result.token_ids)}
            body["decoding"] = {"method": self.method, "oracle_calls": result.oracle_calls,
                                "tokens_per_oracle_call": round(result.tokens_per_oracle_call, 4),
                                "seconds": round(result.seconds, 6)}
        return body

    async def whole(self, request: Request) -> JSONResponse:
        """The whole completion once decoded; a client that leaves meanwhile (checked twice a second) cancels its job
        as a stream's does, and the answer no one reads is a 400."""
        text, check = [], time.monotonic() + DISCONNECT_CHECK
        while True:
            try:
                kind, value = await asyncio.wait_for(self.job.events.get(), DISCONNECT_CHECK)
            except asyncio.TimeoutError:
                kind = value = None
            if time.monotonic() >= check:
                check = time.monotonic() + DISCONNECT_CHECK
                if await request.is_disconnected():
                    self.job.cancelled.set()
                    return answer(RequestError(400, "the client left before its completion was decoded"))
            if kind == "text":
                text.append(value)
            elif kind == "error":
                return answer(failure(value))
            elif kind == "done":
                return JSONResponse(self.body("".join(text), value.finish_reason, value))

    async def events(self):
        try:
            while True:
                kind, value = await self.job.events.get()
                if kind == "text":
                    yield sse(self.body(value, None))
                elif kind == "error":
                    yield sse(failure(value).body())
                    break
                else:
                    final = self.body("", value.finish_reason, value)
                    usage = final.pop("usage")
                    yield sse(final)
                    if self.job.completion.usage_in_stream:
                        yield sse({**final, "choices": [], "usage": usage})
                    break
            yield "data: [DONE]\n\n"
        finally:
            self.job.cancelled.set()  # the client went away, or the answer is complete: nothing more to decode


def sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


def failure(err: Exception) -> RequestError:
    """A decoding's exception as the error the client sees: bad settings are the client's, anything else the server's."""
    if isinstance(err, RequestError):
        return err
    if isinstance(err, InputError):
        return RequestError(400, str(err), err.field)
    return RequestError(500, f"decoding failed: {type(err).__name__}: {err}", kind="server_error")
