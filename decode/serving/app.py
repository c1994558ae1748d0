"""OpenAI's completions API over one SpeculativeDecoder (FastAPI; decode.serve runs it).

    POST /v1/completions        prompt, max_tokens, temperature, top_p, top_k, stop, seed, stream (server-sent events)
    GET  /v1/models             the one model served
    GET  /health                status, queue length, requests completed and cancelled (no API key needed)
    POST /v1/chat/completions   400: chat (messages) is not served; the error names /v1/completions

Up to `max_batch` requests decode at once, each step scoring every one's tree in one oracle forward (decode.batch),
each request's output what it gets alone; the others wait in a bounded queue (a full queue answers 429) and join
between steps. The worker decodes on the process's main thread (torch's OpenMP products ran at half speed on another
thread) while the HTTP server runs on its own. A client that disconnects leaves the batch at the next step. Responses
carry `usage` and, under `decoding`, the method, oracle calls, tokens per oracle call and seconds. Every refusal, an
unknown route or method included, is a 4xx with OpenAI's error object naming the field at fault; only a fault inside
decoding is a 5xx, in the same shape, its traceback logged.
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
from decode.batch import Batch
from decode.errors import InputError
from decode.generation import Stream
from decode.serving.request import SCHEMA, Completion, RequestError, parse_completion
from decode.serving.stop_text import StopText

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


@dataclass
class Flight:
    """A job being decoded: its pieces as the batch's steps make them, and its stop strings over their text."""

    job: Job
    stream: Stream
    text: StopText


class Worker:
    """What decodes: takes jobs from a queue into a batch of up to `max_batch` in flight (decode.batch: each
    step scores every job's tree in one oracle forward), in `run`, until `stop`. Jobs join and leave between steps;
    `max_batch` + `queue_size` jobs decode or wait at most, and `submit` refuses more."""

    def __init__(self, decoder: SpeculativeDecoder, queue_size: int, max_batch: int = 1):
        self.decoder, self.jobs, self.queue_size = decoder, queue.Queue[Job | None](), queue_size
        self.max_batch, self.batch, self.flights = max_batch, Batch(), list[Flight]()
        # a place for each job decoding or waiting: a job submitted while the batch has room waits for the next step
        # (jobs join between steps), so it takes one of the batch's places, not one of the queue's
        self.places = threading.BoundedSemaphore(max_batch + queue_size)
        self.draining = self.stopping = False
        self.completed = self.cancelled = 0

    @property
    def in_flight(self) -> int:
        return len(self.flights)

    def submit(self, job: Job) -> None:
        if self.draining:
            raise RequestError(503, "the server is shutting down", kind="server_error")
        if not self.places.acquire(blocking=False):
            raise RequestError(429, f"the server is busy: {self.max_batch} requests decoding at once and "
                                    f"{self.queue_size} waiting is its most; retry later", kind="rate_limit_error",
                               code="rate_limit_exceeded")
        self.jobs.put_nowait(job)

    def run(self) -> None:
        """Decode until `stop`: the jobs in flight finish, the ones waiting are refused."""
        while self.admit():
            for flight in list(self.flights):
                self.advance(flight)

    def admit(self) -> bool:
        """Take waiting jobs into the batch while it has room (waiting for one while none is in flight); False once
        stopped with none in flight."""
        while not self.stopping and len(self.flights) < self.max_batch:
            try:
                job = self.jobs.get_nowait() if self.flights else self.next_job()
            except queue.Empty:
                break
            if job is None:
                self.stopping = True
            elif self.draining or job.cancelled.is_set():
                self.cancelled += job.cancelled.is_set()
                self.places.release()
                job.emit("error", RequestError(503, "the server is shutting down", kind="server_error"))
            else:
                c = job.completion
                try:
                    stream = self.decoder.stream_in(self.batch, c.ids, max_new_tokens=c.max_tokens, **c.settings)
                except Exception as err:
                    self.places.release()
                    failed(job, err)
                    continue
                self.flights.append(Flight(job, stream, StopText(c.stops)))
        return bool(self.flights) or not self.stopping

    def advance(self, flight: Flight) -> None:
        """One piece of a job's completion (reading it steps the batch where the job has none waiting); its end,
        cancellation or failure takes it out of the batch, and the others go on."""
        job = flight.job
        try:
            piece = None if job.cancelled.is_set() else next(flight.stream, None)
            if job.cancelled.is_set():  # the client went away: it leaves the batch at this step
                flight.stream.close()
                self.cancelled += 1
            elif piece is not None:
                if new := flight.text.feed(piece):
                    job.emit("text", new)
                return
            else:
                if tail := flight.text.flush():
                    job.emit("text", tail)
                self.completed += 1
                job.emit("done", flight.stream.result)
        except Exception as err:  # a job's failure is its own; the others decode on
            failed(job, err)
        self.flights.remove(flight)
        self.places.release()

    def next_job(self) -> Job | None:
        """The next job, waking twice a second meanwhile: signal handlers run on this thread only between waits (a
        wait that never wakes kept SIGTERM's handler from running under one kernel)."""
        while True:
            try:
                return self.jobs.get(timeout=0.5)
            except queue.Empty:
                continue

    def stop(self) -> None:
        self.draining = True
        self.jobs.put(None)


def failed(job: Job, err: Exception) -> None:
    """A job's failure, answered to it (a fault of the server's logged with its traceback, in the except block that
    caught it)."""
    if not isinstance(err, (InputError, RequestError)):
        log.exception("decoding failed")
    job.emit("error", err)


def answer(err: RequestError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def create_app(decoder: SpeculativeDecoder, model: str, api_key: str | None = None, queue_size: int = 16,
               max_body_bytes: int = 1 << 20, read_timeout: float = 30.0, max_batch: int = 1) -> FastAPI:
    """The server's ASGI app over `decoder`, named `model` in its answers; `app.state.worker.run()` must decode its
    jobs (decode.serve runs it on the main thread), and returns once the app has shut down. A request body that takes
    over `read_timeout` seconds to arrive is answered 408. Up to `max_batch` requests decode at once."""
    worker = Worker(decoder, queue_size, max_batch)
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
        return JSONResponse({"status": status, "queued": worker.jobs.qsize(), "in_flight": worker.in_flight,
                             "max_batch": worker.max_batch, "completed": worker.completed, "cancelled": worker.cancelled},
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
