"""The OpenAI-compatible server, started as a user starts it (python -m decode.serve) on a free localhost port, and
spoken to with the real `openai` client and with raw HTTP."""
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import child_env

from decode.api import SpeculativeDecoder
from decode.cli import run

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["def scale(values):\n", "import math\n", "class Box3:\n    def __init__(self):\n", "x = (1, 2",
           "for i in range(10):\n"]


READ_TIMEOUT = 2  # seconds: the module's server closes stalled connections this soon


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m decode.serve` in a subprocess, ready once /health answers."""

    def __init__(self, run_dir: Path, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = child_env()
        self.process = subprocess.Popen([sys.executable, "-m", "decode.serve", "--run", str(run_dir), "--port",
                                         str(self.port), *flags], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 120
        while time.time() < deadline:
            assert self.process.poll() is None, self.process.stdout.read()
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise AssertionError("the server did not start")

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)

    def post(self, body, **kwargs) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(f"{self.url}/v1/completions", content=content, headers={"Content-Type": "application/json"},
                          timeout=60, **kwargs)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)


@pytest.fixture(scope="module")
def server(bpe_run):
    s = Server(bpe_run["run"], "--method", "staged", "--read-timeout", str(READ_TIMEOUT))
    yield s
    assert s.stop() == 0


def test_the_command_the_api_and_the_server_give_the_same_greedy_completion(server, bpe_run):
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["oracle"]
    decoder = SpeculativeDecoder.from_run(bpe_run["run"], method="staged")
    healed = 0
    for prompt in PROMPTS:
        expected = run.main(["--run", str(bpe_run["run"]), "--prompt", prompt, "--max-new-tokens", "24"])[0]
        generated = decoder.generate(prompt, max_new_tokens=24)
        assert (generated.text, generated.token_ids, generated.healed) == \
            (expected["completion"], expected["token_ids"], expected["healed"])
        healed += bool(generated.healed)
        answer = client.completions.create(model="oracle", prompt=prompt, max_tokens=24, temperature=0)
        assert answer.choices[0].text == expected["completion"]
        assert answer.usage.completion_tokens == expected["new_tokens"] and answer.usage.prompt_tokens > 0
        decoding = answer.model_extra["decoding"]
        assert decoding["method"] == "staged" and decoding["oracle_calls"] == expected["oracle_calls"]
        streamed = client.completions.create(model="oracle", prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                             stream_options={"include_usage": True})
        chunks = list(streamed)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected["completion"]
        assert chunks[-2].choices[0].finish_reason in ("stop", "length") and chunks[-1].usage.completion_tokens == \
            expected["new_tokens"]
    assert healed >= 2  # prompts whose last token healing backed off, and the completion re-made
    sampled = {"temperature": 1.0, "top_k": 20, "seed": 5}
    expected = run.main(["--run", str(bpe_run["run"]), "--prompt", PROMPTS[0], "--max-new-tokens", "24", "--temperature", "1",
                         "--top-k", "20", "--seed", "5"])[0]
    assert decoder.generate(PROMPTS[0], max_new_tokens=24, **sampled).token_ids == expected["token_ids"]
    answer = client.completions.create(model="oracle", prompt=PROMPTS[0], max_tokens=24, temperature=1.0, seed=5,
                                       extra_body={"top_k": 20})
    assert answer.choices[0].text == expected["completion"]


def test_stop_sequences_end_the_text_before_them(server):
    client = server.client()
    whole = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=24, temperature=0).choices[0].text
    stop = whole[5:7]
    assert stop and stop in whole
    answer = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop])
    assert answer.choices[0].text == whole[: whole.index(stop)] and answer.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == whole[: whole.index(stop)]


def test_seeded_sampling_is_reproducible_and_unseeded_is_fresh(server):
    client = server.client()
    ask = lambda **extra: client.completions.create(model="m", prompt=PROMPTS[1], max_tokens=24, temperature=1.5,
                                                   **extra).choices[0].text
    assert ask(seed=3) == ask(seed=3)
    assert len({ask() for _ in range(4)}) > 1


@pytest.mark.parametrize("body, status, message", [
    (b"{not json", 400, "not valid JSON"),
    (b'{"prompt": "\xff\xfe"}', 400, "not valid UTF-8"),
    (b'{"prompt": "x = \'\\ud800\'\\n"}', 400, "lone UTF-16 surrogate"),
    (b"[" * 10_000 + b"]" * 10_000, 400, "not valid JSON"),
    (b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", 400, "not valid JSON"),
    ({"max_tokens": 4}, 400, "prompt is required"),
    ({"prompt": ""}, 400, "prompt is empty"),
    ({"prompt": [10**30]}, 400, "prompt token ids must lie in 0.."),
    ({"prompt": "x", "n": 2}, 400, "n must be 1"),
    ({"prompt": "x", "best_of": 3}, 400, "best_of must be 1"),
    ({"prompt": "x", "frobnicate": 1}, 400, "unsupported field frobnicate"),
    ({"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty must be 0"),
    ({"prompt": "x", "max_tokens": -5}, 400, "max_tokens must be an integer of at least 1"),
    ({"prompt": "x", "max_tokens": 10**30}, 400, "use 1.."),
    ({"prompt": "x " * 400}, 400, "leaves no room to generate"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature must be a number"),
    ({"prompt": "x", "temperature": 1e-300}, 400, "temperature must be 0 (greedy) or a finite number of at least"),
    ({"prompt": "x", "top_k": -5}, 400, "top_k must be an integer"),
    ({"prompt": "x", "temperature": 1, "seed": 2**64}, 400, f"seed must be an integer in {-2**63}..{2**64 - 1}"),
    ({"prompt": "x", "temperature": 1, "seed": -(2**70)}, 400, "seed must be an integer in"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop must be a string of 1 to 256 characters or a list of at most 4"),
    ({"prompt": "x" * (2 << 20)}, 413, "over 1048576 bytes"),
])
def test_bad_requests_are_4xx_openai_errors(server, body, status, message):
    answer = server.post(body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert message in error["message"] and error["type"] and "Traceback" not in answer.text
    assert server.post({"prompt": "x", "max_tokens": 2}).status_code == 200  # the server serves on


@pytest.mark.parametrize("method, path, status, message", [
    ("POST", "/v1/chat/completions", 400, "POST /v1/completions with a prompt"),
    ("GET", "/v2/engines", 404, "GET /v2/engines is not an endpoint of this server"),
    ("DELETE", "/v1/completions", 405, "DELETE /v1/completions does not take this method"),
])
def test_chat_unknown_routes_and_methods_are_openai_errors(server, method, path, status, message):
    answer = httpx.request(method, f"{server.url}{path}", json={"messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == status and message in answer.json()["error"]["message"], answer.text


def test_a_client_that_disconnects_stops_its_decoding_and_the_next_request_starts(server):
    # a tiny model's completion may end before the hang-up reaches the server (a busy machine): tries, until one is
    # cancelled, each waited for until it has left the batch one way or the other
    for _ in range(5):
        before = httpx.get(f"{server.url}/health").json()["cancelled"]
        with httpx.stream("POST", f"{server.url}/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 80,
                                                                         "temperature": 1.5, "stream": True}) as answer:
            next(answer.iter_lines())  # the first chunk, then hang up
        deadline = time.time() + 30
        while (health := httpx.get(f"{server.url}/health").json())["in_flight"] and time.time() < deadline:
            time.sleep(0.02)
        if health["cancelled"] > before:
            break
    assert health["cancelled"] == before + 1 and health["in_flight"] == 0 and health["queued"] == 0
    assert server.client().completions.create(model="m", prompt="x", max_tokens=4, temperature=0).choices[0].text is not None


def test_eight_clients_at_once_are_served_in_turn_with_the_same_outputs(server):
    client = server.client()
    requests = [(prompt, temperature, seed) for seed, prompt in enumerate(PROMPTS) for temperature in (0.0, 1.0)]
    alone = {r: client.completions.create(model="m", prompt=r[0], max_tokens=24, temperature=r[1], seed=r[2])
             .choices[0].text for r in requests}
    answers, failures = {}, []

    def user(index: int):
        mine = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        for j in range(5):
            r = requests[(index + j) % len(requests)]
            try:
                answers[(index, j)] = (r, mine.completions.create(model="m", prompt=r[0], max_tokens=24,
                                                                  temperature=r[1], seed=r[2]).choices[0].text)
            except Exception as err:  # counted, then asserted: every request must complete
                failures.append(repr(err))

    threads = [threading.Thread(target=user, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not failures and len(answers) == 40
    assert all(text == alone[r] for r, text in answers.values())  # greedy and seeded sampling alike


def test_requests_in_flight_together_each_get_their_own_completion_and_the_start_line_says_how_many(bpe_run):
    s = Server(bpe_run["run"], "--method", "speculative", "--max-batch", "3")
    try:
        decoder = SpeculativeDecoder.from_run(bpe_run["run"], method="speculative")
        requests = [(prompt, {"temperature": 0.0} if i % 2 else {"temperature": 1.0, "seed": i}, i % 3 == 0)
                    for i, prompt in enumerate(PROMPTS + PROMPTS[:3])]  # greedy and seeded, some streamed
        got, failures, barrier = {}, [], threading.Barrier(len(requests))

        def user(i: int):
            prompt, settings, stream = requests[i]
            barrier.wait()
            try:
                answer = s.client().completions.create(model="m", prompt=prompt, max_tokens=20, stream=stream, **settings)
                got[i] = "".join(c.choices[0].text for c in answer) if stream else answer.choices[0].text
            except Exception as err:  # counted, then asserted: every request must complete
                failures.append(repr(err))

        threads = [threading.Thread(target=user, args=(i,)) for i in range(len(requests))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not failures and len(got) == len(requests)
        for i, (prompt, settings, _) in enumerate(requests):
            sampling = {"do_sample": True, "temperature": 1.0, "seed": settings["seed"]} if "seed" in settings else {}
            assert got[i] == decoder.generate(prompt, max_new_tokens=20, **sampling).text
        health = httpx.get(f"{s.url}/health").json()
        assert (health["max_batch"], health["in_flight"], health["completed"]) == (3, 0, len(requests))
    finally:
        assert s.stop() == 0
    start = s.process.stdout.read()
    assert "up to 3 requests at once (--max-batch" in start and "and 16 waiting (--queue-size)" in start


def raw(server, data: bytes) -> socket.socket:
    """A connection to the server that has sent `data` and nothing more."""
    connection = socket.create_connection(("127.0.0.1", server.port), timeout=READ_TIMEOUT + 30)
    connection.sendall(data)
    return connection


def test_stalled_headers_are_closed_and_a_stalled_body_is_answered_408(server):
    with raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le") as headers:
        assert headers.recv(1000) == b""  # closed, with no answer: there was no request yet
    with raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ") as body:
        answer = b"".join(iter(lambda: body.recv(10_000), b"")).decode()  # answered, then closed
        assert answer.startswith("HTTP/1.1 408") and f"did not arrive within {READ_TIMEOUT} seconds" in answer
    assert server.post({"prompt": "x", "max_tokens": 2}).status_code == 200


def test_hostile_sizes_are_answered_and_the_worker_serves_on(server, bpe_run):
    limit = 1 << 20
    padded = {"prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0, "user": ""}
    padded["user"] = "u" * (limit - len(json.dumps(padded)))
    assert len(json.dumps(padded)) == limit and server.post(padded).status_code == 200
    context = json.loads((bpe_run["run"] / "oracle" / "config.json").read_text())["n_positions"]
    answer = server.post({"prompt": [1] * context, "max_tokens": 1})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "context_length_exceeded"
    flood = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"v" * 50) for i in range(5000))
    with raw(server, flood + b"\r\n") as connection:
        assert connection.recv(1000).startswith(b"HTTP/1.1 4")
    whole = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"v" * 20_000 + b"\r\n\r\n"  # in one piece
    with raw(server, whole) as connection:
        assert connection.recv(1000).startswith(b"HTTP/1.1 431")
    near = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"v" * 16_000 + b"\r\n\r\n"
    with raw(server, near) as connection:
        assert connection.recv(1000).startswith(b"HTTP/1.1 200")
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    assert server.post({"prompt": "x", "max_tokens": 2}).status_code == 200


def test_requests_past_the_batch_and_the_queue_get_429_and_none_before(bpe_run):
    s = Server(bpe_run["run"], "--method", "baseline", "--max-batch", "4", "--queue-size", "1")

    def burst(requests: int, stream: bool) -> list[httpx.Response]:
        barrier, answers = threading.Barrier(requests), []

        def hit():
            barrier.wait()
            answers.append(s.post({"prompt": PROMPTS[0], "max_tokens": 120, "temperature": 0, "stream": stream}))

        threads = [threading.Thread(target=hit) for _ in range(requests)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        return answers

    try:
        answers = burst(12, stream=False)
        codes = [a.status_code for a in answers]
        # a burst that arrives within a step: 4 decode and 1 waits, though none has joined the batch yet
        assert codes.count(200) >= 5 and 429 in codes and set(codes) <= {200, 429}
        busy = next(a for a in answers if a.status_code == 429).json()["error"]
        assert busy["type"] == "rate_limit_error" and "4 requests decoding at once and 1 waiting" in busy["message"]
        for stream in (True, False):  # every place comes back once its request ends
            assert [a.status_code for a in burst(5, stream)] == [200] * 5
    finally:
        assert s.stop() == 0


def test_an_api_key_guards_every_endpoint_but_health(bpe_run):
    s = Server(bpe_run["run"], "--method", "lookup", "--api-key", "sesame")
    try:
        assert httpx.get(f"{s.url}/health").status_code == 200
        for key in (None, "wrong"):
            headers = {} if key is None else {"Authorization": f"Bearer {key}"}
            assert httpx.get(f"{s.url}/v1/models", headers=headers).status_code == 401
            refused = httpx.post(f"{s.url}/v1/completions", json={"prompt": "x"}, headers=headers)
            assert refused.status_code == 401 and "API key" in refused.json()["error"]["message"]
        for scheme in ("bearer", "BEARER"):  # the scheme's name in any case (RFC 7235)
            assert httpx.get(f"{s.url}/v1/models", headers={"Authorization": f"{scheme} sesame"}).status_code == 200
        assert httpx.get(f"{s.url}/v1/models", headers={"Authorization": "Basic sesame"}).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").completions.create(model="m", prompt="x", max_tokens=2)
        assert s.client("sesame").completions.create(model="m", prompt="x", max_tokens=2, temperature=0).choices
    finally:
        assert s.stop() == 0


def test_sigterm_finishes_the_request_in_progress_refuses_new_ones_and_exits_0(bpe_run):
    s = Server(bpe_run["run"], "--method", "baseline")
    with httpx.stream("POST", f"{s.url}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 90, "temperature": 0,
                                                                "stream": True, "stream_options": {"include_usage": True}},
                      timeout=60) as answer:
        lines = answer.iter_lines()
        first = next(line for line in lines if line)
        s.process.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    chunks = [json.loads(line[len("data: "):]) for line in [first, *rest[:-1]]]
    assert rest[-1] == "data: [DONE]" and chunks[-1]["usage"]["completion_tokens"] == 90
    assert s.process.wait(timeout=60) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{s.url}/health", timeout=2)


def test_an_address_in_use_is_a_one_line_error_before_the_models_load(bpe_run):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "decode.serve", "--run", str(bpe_run["run"]), "--port", str(port)],
                              cwd=ROOT, env=child_env(), capture_output=True, text=True,
                              timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert [line for line in done.stderr.splitlines() if line.startswith("error:")] == [
        next(line for line in done.stderr.splitlines() if line.startswith("error:"))]
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and "--port" in done.stderr


@pytest.mark.parametrize("flag, value, said", [
    ("--max-batch", "0", "--max-batch 0 is out of range: use 1..256"),
    ("--max-batch", "257", "--max-batch 257 is out of range: use 1..256"),
    ("--port", "99999", "--port 99999 is out of range: use 0..65535"),
    ("--queue-size", "0", "--queue-size must be at least 1 (got 0)"),
    ("--max-body-bytes", "-1", "--max-body-bytes must be at least 1 (got -1)")])
def test_a_setting_out_of_range_is_a_usage_error_naming_it(flag, value, said):
    done = subprocess.run([sys.executable, "-m", "decode.serve", "--oracle", "none", flag, value], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr and said in done.stderr


def test_the_server_serves_a_quantized_oracle_as_it_is(bpe_run, tmp_path):
    from decode.cli import quantize

    oracle = tmp_path / "oracle-q8_0"
    quantize.main(["--model", str(bpe_run["run"] / "oracle"), "--to", "q8_0", "--out", str(oracle), "--eval-tokens", "0"])
    expected = SpeculativeDecoder.from_pretrained(oracle, method="baseline").generate(PROMPTS[0], max_new_tokens=12).text
    s = Server(bpe_run["run"], "--oracle", str(oracle), "--method", "speculative", "--k", "3")
    try:
        reply = s.post({"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0})
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == expected
    finally:
        assert s.stop() == 0


def test_the_start_line_says_whether_greedy_requests_follow_the_plans_levels_of_load(tmp_path):
    from decode.cli.serve import load_levels

    levels, single, damaged = tmp_path / "levels.json", tmp_path / "single.json", tmp_path / "damaged.json"
    levels.write_text(json.dumps({"policies": {}, "concurrency": {"1": {}, "2": {}, "4": {}}}))
    single.write_text(json.dumps({"policies": {}}))
    damaged.write_text("{")
    assert load_levels(levels, 4) == "; greedy requests take the plan's policies for 1, 2 and 4 in flight"
    assert load_levels(levels, 2) == "; greedy requests take the plan's policies for 1 and 2 in flight"
    for plan in (single, damaged):
        assert load_levels(plan, 4).startswith("; one policy at any load (decode.plan --concurrency 1,4 plans one")
    assert load_levels(None, 4) == load_levels(levels, 1) == ""
