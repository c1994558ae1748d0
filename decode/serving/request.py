"""The body of POST /v1/completions: OpenAI's completions request as a pydantic model (which the app's OpenAPI
schema publishes), and its check against the decoder that will serve it (the prompt's tokens, the context's room).

Every field's description is the rule a bad value breaks: a refused request's error quotes it, naming the field.
"""
import json
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from decode.api import SpeculativeDecoder
from decode.errors import InputError
from decode.generation import SEED_RANGE
from decode.options import MIN_TEMPERATURE, sampling_of

MAX_STOPS = 4
MAX_STOP_LENGTH = 256  # characters a stop string may have: matching stays cheap whatever the client sends
EXACT = "the output follows the oracle's own distribution, which a penalty or a bias would change"


class RequestError(Exception):
    """A request the server refuses: its HTTP status and an OpenAI-style error."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def rule(text: str, **constraints):
    """A pydantic Field whose description is the rule its constraints enforce."""
    return Field(description=text, **constraints)


Text = Annotated[StrictStr, Field(min_length=1)]
StopText = Annotated[StrictStr, Field(min_length=1, max_length=MAX_STOP_LENGTH)]


class CompletionRequest(BaseModel):
    """OpenAI's completions request, as this server takes it: one prompt, one completion, the oracle's own tokens."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    prompt: StrictStr | list[StrictStr] | list[StrictInt] = rule(
        "a string, a list of one string, or a list of token ids")
    model: StrictStr | None = rule("any name: one model is served", default=None)
    max_tokens: StrictInt | None = rule("an integer of at least 1 that fits the context after the prompt", default=16,
                                        ge=1)
    temperature: StrictFloat | None = rule(f"a number: 0 for greedy decoding, else a sampling temperature of at least {MIN_TEMPERATURE}",
                                           default=1.0, ge=0)
    top_p: StrictFloat | None = rule("a number in (0, 1]: the smallest set of tokens with this much probability",
                                     default=1.0, gt=0, le=1)
    top_k: StrictInt | None = rule("an integer of -1 or more: the k most likely tokens, -1 or 0 for all", default=0, ge=-1)
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOPS)] | None = rule(
        f"a string of 1 to {MAX_STOP_LENGTH} characters or a list of at most {MAX_STOPS} of them", default=None)
    seed: StrictInt | None = rule(f"an integer in {SEED_RANGE[0]}..{SEED_RANGE[1]}", default=None,
                                  ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stream: StrictBool | None = rule("true or false: server-sent events as tokens are accepted", default=False)
    stream_options: dict[Literal["include_usage"], StrictBool] | None = rule(
        "an object with include_usage (true or false) only", default=None)
    n: Literal[1] | None = rule("1: one decoder decodes one completion at a time", default=1)
    best_of: Literal[1] | None = rule("1: one decoder decodes one completion at a time", default=None)
    user: StrictStr | None = rule("any string", default=None)
    echo: Literal[False] | None = rule("false: the completion holds the new text only", default=False)
    logprobs: None = rule("null: log-probabilities are not returned", default=None)
    suffix: None = rule("null: text after the insertion point is not served", default=None)
    presence_penalty: Literal[0] | None = rule(f"0: {EXACT}", default=0)
    frequency_penalty: Literal[0] | None = rule(f"0: {EXACT}", default=0)
    logit_bias: dict[str, StrictFloat] | None = rule(f"empty: {EXACT}", default=None, max_length=0)


SCHEMA = CompletionRequest.model_json_schema()  # no nested models: it stands alone in the OpenAPI document


@dataclass
class Completion:
    """One checked request: its prompt's token ids and what to decode."""

    ids: list[int]
    max_tokens: int
    settings: dict  # SpeculativeDecoder.generate's: do_sample, temperature, top_k, top_p, seed, stop_strings
    stops: tuple[str, ...]
    stream: bool
    usage_in_stream: bool


def refusal(err: ValidationError) -> RequestError:
    """The first thing wrong with a body, as the error a client reads: the field and the rule it breaks."""
    first = err.errors()[0]
    kind, where = first["type"], first["loc"]
    if kind == "json_invalid":
        if "surrogate" in first["msg"] or "hex escape" in first["msg"]:
            return RequestError(400, "the request body holds a lone UTF-16 surrogate (\\ud800-\\udfff without its "
                                     "pair), which is not text; send valid Unicode")
        return RequestError(400, f"the request body is not valid JSON ({first['msg'].removeprefix('Invalid JSON: ')})")
    if not where:
        return RequestError(400, "the request body must be a JSON object")
    name = str(where[0])
    if kind == "extra_forbidden":
        return RequestError(400, f"unsupported field {name}; this endpoint takes "
                                 f"{', '.join(CompletionRequest.model_fields)}", name)
    if kind == "missing":
        return RequestError(400, f"{name} is required", name)
    got = json.dumps(first["input"]) if isinstance(first["input"], (int, float, str, bool, type(None))) else \
        f"a JSON {'array' if isinstance(first['input'], list) else 'object'}"
    got = got if len(got) <= 60 else got[:57] + "..."
    return RequestError(400, f"{name} must be {CompletionRequest.model_fields[name].description} (got {got})", name)


def parse_completion(body: bytes, decoder: SpeculativeDecoder) -> Completion:
    """The request body, checked as OpenAI's completions endpoint reads it and against what `decoder` can serve;
    RequestError when it cannot be served."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestError(400, "the request body is not valid UTF-8") from None
    try:
        request = CompletionRequest.model_validate_json(body)
    except ValidationError as err:
        raise refusal(err) from None
    ids = prompt_ids(request.prompt, decoder)
    temperature = 1.0 if request.temperature is None else request.temperature
    top_k, top_p = max(request.top_k or 0, 0), 1.0 if request.top_p is None else request.top_p
    try:
        sampling = sampling_of(temperature, top_k, top_p)
    except InputError as err:
        raise RequestError(400, str(err), err.field) from None
    max_tokens = 16 if request.max_tokens is None else request.max_tokens
    room = decoder.room(len(ids), decoder.lookahead(sampling))  # its setting's tree
    context = decoder.decoder.context()
    if room < 1:
        raise RequestError(400, f"the prompt has {len(ids)} tokens; the model's context of {context} tokens leaves no "
                                f"room to generate: shorten it", "prompt", code="context_length_exceeded")
    if max_tokens > room:
        raise RequestError(400, f"max_tokens {max_tokens} does not fit the model's context of {context} tokens after a "
                                f"prompt of {len(ids)}: use 1..{room}", "max_tokens", code="context_length_exceeded")
    stops = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    settings = {"do_sample": temperature > 0, "temperature": temperature or None, "top_k": top_k, "top_p": top_p,
                "seed": request.seed, "stop_strings": stops}
    return Completion(ids, max_tokens, settings, stops, bool(request.stream),
                      bool((request.stream_options or {}).get("include_usage")))


def prompt_ids(prompt: str | list, decoder: SpeculativeDecoder) -> list[int]:
    """A prompt as text, a list of one text, or token ids, as token ids."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise RequestError(400, f"prompt must be one text: this server decodes one completion per request (got "
                                    f"{len(prompt)} texts)", "prompt")
        prompt = prompt[0]
    if not prompt:
        raise RequestError(400, "prompt is empty; give some text or token ids to continue", "prompt")
    if isinstance(prompt, str):
        try:
            return decoder.token_ids(prompt)
        except InputError as err:
            raise RequestError(400, str(err), "prompt") from None
    vocabulary = decoder.decoder.oracle.vocab_size
    if not all(0 <= t < vocabulary for t in prompt):
        raise RequestError(400, f"prompt token ids must lie in 0..{vocabulary - 1}", "prompt")
    return prompt
