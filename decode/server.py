"""An OpenAI-compatible completions server over one SpeculativeDecoder (FastAPI; decode.serve runs it).

    POST /v1/completions   prompt, max_tokens, temperature, top_p, top_k, stop, seed, stream (server-sent events)
    GET  /v1/models        the one model served
    GET  /health           status, queue length, requests completed and cancelled (no API key needed)

One decoder decodes one request at a time, as batch one is the design: requests wait in a bounded queue (a full
queue answers 429) and the worker takes them in turn, on the process's main thread (torch's OpenMP products ran at
half speed on another thread here) while the HTTP server runs on its own. A streaming client that disconnects stops its own
decoding at the next step. Responses carry `usage` and, under `decoding`, the method, oracle calls, tokens per
oracle call and seconds. Bad requests are 4xx answers with an OpenAI-style error object.
"""
import asyncio
import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from data.errors import InputError
from decode.api import SpeculativeDecoder
from decode.sampling import Sampling

FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream", "stream_options",
          "n", "best_of", "user", "echo", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "suffix"}
MAX_STOPS = 4


class RequestError(Exception):
    """A request the server refuses: its HTTP status and an OpenAI-style error."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}},
                            status_code=self.status)


@dataclass
class Completion:
    """One checked request: its prompt's token ids and what to decode."""

    ids: list[int]
    max_tokens: int
    settings: dict  # SpeculativeDecoder.generate's: do_sample, temperature, top_k, top_p, seed, stop_strings
    stops: tuple[str, ...]
    stream: bool
    usage_in_stream: bool


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
    still begin one held back until it cannot."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.text, self.shown, self.stopped = stops, "", 0, False

    def feed(self, piece: str) -> str:
        """The newly visible text after `piece`."""
        self.text += piece
        found = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
        if found:
            end, self.stopped = min(found), True
        else:
            held = max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
            end = len(self.text) - held
        new, self.shown = self.text[self.shown : max(end, self.shown)], max(end, self.shown)
        return new

    def flush(self) -> str:
        """The held-back tail, once the text is complete and no stop string came."""
        if self.stopped:
            return ""
        new, self.shown = self.text[self.shown :], len(self.text)
        return new


def parse_completion(body: bytes, decoder: SpeculativeDecoder) -> Completion:
    """The request body, checked as OpenAI's completions endpoint reads it; RequestError when it cannot be served."""
    try:
        request = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise RequestError(400, "the request body is not valid UTF-8") from None
    except json.JSONDecodeError as err:
        raise RequestError(400, f"the request body is not valid JSON ({err.msg} at line {err.lineno} column {err.colno})") from None
    if not isinstance(request, dict):
        raise RequestError(400, "the request body must be a JSON object")
    unknown = sorted(set(request) - FIELDS)
    if unknown:
        raise RequestError(400, f"unsupported fields: {', '.join(unknown)}", unknown[0])
    for name, allowed in (("n", 1), ("best_of", 1)):
        if request.get(name, allowed) not in (allowed, None):
            raise RequestError(400, f"{name} must be 1: one decoder decodes one completion at a time", name)
    for name, neutral in (("echo", False), ("logprobs", None), ("suffix", None), ("presence_penalty", 0),
                          ("frequency_penalty", 0), ("logit_bias", None)):
        if request.get(name, neutral) not in (neutral, None, {} if name == "logit_bias" else neutral):
            raise RequestError(400, f"{name} is not supported: the output is exactly the oracle's", name)
    ids = prompt_ids(request.get("prompt"), decoder)
    max_tokens = number(request, "max_tokens", 16, int, minimum=1)
    temperature = number(request, "temperature", 1.0, float, minimum=0.0)
    top_p = number(request, "top_p", 1.0, float, minimum=0.0)
    if not 0 < top_p <= 1:
        raise RequestError(400, f"top_p must lie in (0, 1] (got {top_p})", "top_p")
    top_k = number(request, "top_k", 0, int, minimum=-1)
    room = decoder.room(len(ids), decoder.lookahead(Sampling(temperature, max(top_k, 0), top_p)))  # its setting's tree
    context = decoder.decoder.context()
    if room < 1:
        raise RequestError(400, f"the prompt has {len(ids)} tokens; the model's context of {context} tokens leaves no "
                                f"room to generate: shorten it", "prompt", code="context_length_exceeded")
    if max_tokens > room:
        raise RequestError(400, f"max_tokens {max_tokens} does not fit the model's context of {context} tokens after a "
                                f"prompt of {len(ids)}: use at most {room}", "max_tokens", code="context_length_exceeded")
    seed = request.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise RequestError(400, f"seed must be an integer (got {seed!r})", "seed")
    stops = request.get("stop") or ()
    stops = (stops,) if isinstance(stops, str) else stops
    if not isinstance(stops, (list, tuple)) or len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(400, f"stop must be a string or a list of at most {MAX_STOPS} non-empty strings", "stop")
    stream = request.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, f"stream must be true or false (got {stream!r})", "stream")
    options = request.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise RequestError(400, "stream_options takes only include_usage", "stream_options")
    settings = {"do_sample": temperature > 0, "temperature": temperature or None, "top_k": max(top_k, 0), "top_p": top_p,
                "seed": seed, "stop_strings": tuple(stops)}
    return Completion(ids, max_tokens, settings, tuple(stops), stream, bool(options.get("include_usage")))


def prompt_ids(prompt, decoder: SpeculativeDecoder) -> list[int]:
    """A prompt as text, a list of one text, or token ids, as token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError(400, "prompt is empty; give some text to continue", "prompt")
        return decoder.tokenizer(prompt, add_special_tokens=False).input_ids
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocabulary = decoder.decoder.oracle.vocab_size
        if not all(0 <= t < vocabulary for t in prompt):
            raise RequestError(400, f"prompt token ids must lie in 0..{vocabulary - 1}", "prompt")
        return prompt
    if prompt is None:
        raise RequestError(400, "prompt is required", "prompt")
    raise RequestError(400, "prompt must be a string, a list of one string, or a list of token ids", "prompt")


def number(request: dict, name: str, default, kind: type, minimum):
    """request[name] (or its default) as a number of `kind`, at least `minimum`."""
    value = request.get(name, default)
    value = default if value is None else value
    valid = isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or float(value).is_integer())
    if not valid or value != value or value in (float("inf"), float("-inf")):
        raise RequestError(400, f"{name} must be {'an integer' if kind is int else 'a number'} (got {value!r})", name)
    if value < minimum:
        raise RequestError(400, f"{name} must be at least {minimum} (got {value})", name)
    return kind(value)


class Worker:
    """What decodes: takes jobs from a bounded queue in turn, in `run`, until `stop`."""

    def __init__(self, decoder: SpeculativeDecoder, queue_size: int):
        self.decoder, self.jobs = decoder, queue.Queue(maxsize=queue_size)
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


def create_app(decoder: SpeculativeDecoder, model: str, api_key: str | None = None, queue_size: int = 16,
               max_body_bytes: int = 1 << 20) -> FastAPI:
    """The server's ASGI app over `decoder`, named `model` in its answers; `app.state.worker.run()` must decode its
    jobs (decode.serve runs it on the main thread), and returns once the app has shut down."""
    worker = Worker(decoder, queue_size)

    async def lifespan(app: FastAPI):
        yield
        worker.stop()

    app = FastAPI(title="staged-speculative", lifespan=lifespan)
    app.state.worker = worker
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)

    @app.exception_handler(RequestError)
    async def refused(request: Request, err: RequestError):
        return err.response()

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

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                raise RequestError(413, f"the request body is over {max_body_bytes} bytes")
        completion = parse_completion(bytes(body), decoder)
        job = Job(completion, asyncio.get_running_loop())
        worker.submit(job)
        answer = Answer(job, model, decoder.options.method)
        if completion.stream:
            return StreamingResponse(answer.events(), media_type="text/event-stream")
        try:
            return await answer.whole()
        except asyncio.CancelledError:
            job.cancelled.set()
            raise

    return app


class Guard:
    """Plain ASGI middleware (it leaves streaming and disconnects alone): the API key on every path but /health,
    and a declared body size over the limit refused before it is read."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            refusal = None
            if self.api_key is not None and scope["path"] != "/health" and headers.get("authorization") != f"Bearer {self.api_key}":
                refusal = RequestError(401, "a valid API key is required: send Authorization: Bearer KEY",
                                       kind="authentication_error", code="invalid_api_key")
            elif headers.get("content-length", "").isdigit() and int(headers["content-length"]) > self.max_body_bytes:
                refusal = RequestError(413, f"the request body is over {self.max_body_bytes} bytes")
            if refusal is not None:
                return await refusal.response()(scope, receive, send)
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

    async def whole(self) -> JSONResponse:
        text = []
        while True:
            kind, value = await self.job.events.get()
            if kind == "text":
                text.append(value)
            elif kind == "error":
                return failure(value).response()
            else:
                return JSONResponse(self.body("".join(text), value.finish_reason, value))

    async def events(self):
        try:
            while True:
                kind, value = await self.job.events.get()
                if kind == "text":
                    yield sse(self.body(value, None))
                elif kind == "error":
                    err = failure(value)
                    yield sse({"error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.code}})
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
        return RequestError(400, str(err))
    return RequestError(500, f"decoding failed: {type(err).__name__}: {err}", kind="server_error")
