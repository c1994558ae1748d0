"""The server fuzzed from its own OpenAPI schema (schemathesis, in-process over ASGI, a tiny model): requests that fit
the schema and requests that break it are answered 2xx or 4xx in OpenAI's error shape, never 5xx, and the server
decodes exactly afterwards; the limits on a request's stop strings, and their matching on streamed text."""
import json
import threading
import time

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from decode.api import SpeculativeDecoder
from decode.serving.app import create_app
from decode.serving.stop_text import StopText

PROMPT = "def scale(values):\n"
EXAMPLES = 100  # per generation mode, over every operation


@pytest.fixture(scope="module")
def decoder(bpe_run):
    return SpeculativeDecoder.from_run(bpe_run["run"], method="staged")


@pytest.fixture(scope="module")
def app(decoder):
    app = create_app(decoder, "oracle", queue_size=4)
    worker = threading.Thread(target=app.state.worker.run, daemon=True)
    worker.start()
    yield app
    app.state.worker.stop()
    worker.join(timeout=60)


class WithoutLifespan:
    """The app with its lifespan acknowledged but not run: the ASGI test client starts and ends a lifespan for every
    call, and the app's end stops its worker."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})


def openai_error(body) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return (isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
            and isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str))


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_request_from_the_schema_gets_a_2xx_or_an_openai_4xx(app, mode):
    schema = schemathesis.openapi.from_asgi("/openapi.json", WithoutLifespan(app))
    completions = []  # the statuses POST /v1/completions answered

    @given(case=schema.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    def answered(case):
        response = case.call()
        assert response.status_code < 500, (case.as_curl_command(), response.text)
        if response.status_code >= 400:
            assert openai_error(response.json()), (case.as_curl_command(), response.text)
        if (case.method, case.path) == ("POST", "/v1/completions"):
            completions.append(response.status_code)

    answered()
    assert 400 in completions and (mode == GenerationMode.NEGATIVE or 200 in completions), completions


def test_after_the_fuzzing_a_greedy_request_is_the_decoders_own_text(app, decoder):
    from fastapi.testclient import TestClient

    expected = decoder.generate(PROMPT, max_new_tokens=24)
    answer = TestClient(app).post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "temperature": 0})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == expected.text
    assert answer.json()["usage"]["completion_tokens"] == len(expected.token_ids)


def test_a_fault_inside_decoding_is_a_500_in_openai_shape_with_its_traceback_logged(app, decoder, monkeypatch, caplog):
    from fastapi.testclient import TestClient

    def broken(*args, **kwargs):
        raise RuntimeError("a kernel fell over")

    monkeypatch.setattr(decoder, "stream_in", broken)
    answer = TestClient(app).post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
    assert answer.status_code == 500 and openai_error(answer.json()), answer.text
    assert answer.json()["error"]["type"] == "server_error" and "a kernel fell over" in answer.json()["error"]["message"]
    logged = [r for r in caplog.records if r.name == "decode.serve" and r.exc_info]
    assert logged and "a kernel fell over" in str(logged[0].exc_info[1])


def test_a_stop_string_past_the_limit_is_a_400_naming_it_and_the_longest_allowed_ones_are_served(app):
    from fastapi.testclient import TestClient

    from decode.serving.request import MAX_STOP_LENGTH

    client = TestClient(app)
    refused = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 64, "temperature": 0,
                                                   "stop": "\u0000" + "x" * 999_999})
    assert refused.status_code == 400 and openai_error(refused.json())
    assert refused.json()["error"]["param"] == "stop" and str(MAX_STOP_LENGTH) in refused.json()["error"]["message"]
    longest = ["\u0000" + "x" * (MAX_STOP_LENGTH - 1)] * 4
    answer = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 64, "temperature": 0, "stop": longest})
    assert answer.status_code == 200


def test_stop_text_holds_back_exactly_the_tail_that_could_begin_a_stop_string():
    import random

    def quadratic(stops, pieces):  # every prefix of every stop string against the end of the whole text
        text, shown, out = "", 0, []
        for piece in pieces:
            text += piece
            found = [i for i in (text.find(s) for s in stops) if i >= 0]
            end = min(found) if found else len(text) - max(
                (k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            out.append(text[shown : max(end, shown)])
            shown = max(end, shown)
            if found:
                return out
        return out

    rng = random.Random(0)
    for _ in range(2000):
        alphabet = "ab\u0000c"[: rng.randint(2, 4)]
        stops = tuple("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4)))
        pieces = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4))) for _ in range(rng.randint(1, 12))]
        stop_text, got = StopText(stops), []
        for piece in pieces:
            got.append(stop_text.feed(piece))
            if stop_text.stopped:
                break
        assert got == quadratic(stops, pieces), (stops, pieces)


def test_clients_that_leave_mid_body_leave_no_traceback_and_at_most_a_line_in_the_log(app, caplog):
    import asyncio
    import logging

    async def leave_mid_body():
        messages = [{"type": "http.request", "body": b'{"prompt": "def f', "more_body": True}, {"type": "http.disconnect"}]

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message):
            pass

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
                 "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")],
                 "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
        await WithoutLifespan(app)(scope, receive, send)

    caplog.set_level(logging.INFO)
    for _ in range(20):
        asyncio.run(leave_mid_body())
    assert not [r for r in caplog.records if r.exc_info]
    assert len([r for r in caplog.records if "left before" in r.getMessage()]) <= 1


@pytest.mark.pipeline  # runs the planner
def test_a_damaged_plan_of_any_setting_keeps_the_server_from_starting_in_one_line(bpe_run, tmp_path, capsys,
                                                                                   monkeypatch):
    import shutil

    from decode.cli import plan, serve
    from decode.planning import costs, search

    run = tmp_path / "run"
    shutil.copytree(bpe_run["run"], run)
    monkeypatch.setattr(costs, "CACHE_DIR", tmp_path / "costs")
    monkeypatch.setattr(search, "BUDGETS", (4, 8))
    monkeypatch.setattr(search, "STAGED_WIDTHS", ((2, 1, 1),))
    plan.main(["--run", str(run), "--prompts", str(bpe_run["prompts"]), "--max-new-tokens", "8", "--calibration", "2",
               "--screen", "2", "--max-budget", "8", "--max-depth", "3", "--draft-vocab", "0"])  # RUN/plan.json: greedy
    (run / "plan-t1-k50-p1.json").write_text("{not a plan")  # top-k 50's own plan, damaged
    with pytest.raises(SystemExit) as refused:
        serve.main(["--run", str(run), "--port", "0"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert refused.value.code == 2 and len(errors) == 1 and "plan-t1-k50-p1.json" in errors[0]


def test_a_setting_the_server_cannot_decode_with_is_a_400_with_its_reason(app, decoder, monkeypatch):
    from fastapi.testclient import TestClient

    from decode.errors import InputError

    def refused(sampling):
        raise InputError("RUN/plan-t1-k50-p1.json is not a plan this version of decode.plan wrote")

    monkeypatch.setattr(decoder, "lookahead", refused)
    answer = TestClient(app).post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 1})
    assert answer.status_code == 400 and "is not a plan" in answer.json()["error"]["message"]


def test_a_non_streaming_request_whose_client_left_is_cancelled_like_a_stream(app, decoder, monkeypatch):
    import asyncio

    from decode.generation import Stream
    from decode.serving import app as serving

    def slow(batch, ids, **settings):  # a long completion: a piece every 20 ms
        def pieces():
            for _ in range(500):
                time.sleep(0.02)
                yield "x"
        return Stream(pieces())

    monkeypatch.setattr(decoder, "stream_in", slow)
    monkeypatch.setattr(serving, "DISCONNECT_CHECK", 0.05)
    worker = app.state.worker
    cancelled = worker.cancelled
    body = json.dumps({"prompt": PROMPT, "max_tokens": 8}).encode()  # (the slow stream gives 500 pieces whatever it asks)

    async def leave_after_sending():
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        sent = time.monotonic()

        async def receive():  # as uvicorn's: the body, then nothing until the client goes away (0.2 s later)
            if messages:
                return messages.pop(0)
            while time.monotonic() < sent + 0.2:
                await asyncio.sleep(0.01)
            return {"type": "http.disconnect"}

        async def send(message):
            pass

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
                 "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
                 "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
        await WithoutLifespan(app)(scope, receive, send)

    asyncio.run(leave_after_sending())
    deadline = time.perf_counter() + 5
    while worker.cancelled == cancelled and time.perf_counter() < deadline:
        time.sleep(0.05)
    assert worker.cancelled == cancelled + 1  # (decoded to the end, the job would have counted as completed)
