"""The OpenAI wire format of `boosttune serve`: request schemas, their validation, response bodies.

Requests are checked in layers, each with its own status, so that clients learn what to fix:

- the body is not JSON, not UTF-8, or not a JSON object: 400 (``invalid_json``);
- a number holds an integer of more digits than Python converts (``sys.get_int_max_str_digits()``,
  4,300 by default), in any field, ignored ones too: 400 (``invalid_value``, naming the field);
- a string holds a lone UTF-16 surrogate (``"\\ud800"`` in JSON; no tokenizer takes it): 400
  (``invalid_value``);
- a field is missing or has the wrong JSON type (pydantic, strict: ``"5"`` is not a number and
  ``true`` is not an integer): 422 (``invalid_type`` / ``missing_required_parameter``);
- a value is out of range, unsupported (n > 1, logprobs, penalties, tools) or does not fit the
  context: 400 (``invalid_value``, ``unsupported_parameter``, ``context_length_exceeded``).

An unknown model is 404 (``model_not_found``); an oversized body 413 (server.py). Every error body is
``{"error": {"message", "type", "param", "code"}}``. Unknown fields are ignored, as many clients send
extras. Extensions beyond OpenAI's schema: ``top_k`` (sampling) and ``return_token_ids``. The latter
adds the generated ids to the ``boosttune`` statistics of the response and, in a whole (non-streamed)
response, the fields vLLM's extension of the same name adds (vLLM's ``CompletionResponseChoice``,
vllm/entrypoints/openai/protocol.py): ``token_ids`` (the generated ids, an EOS included) and
``prompt_token_ids`` in the choice of a completion; for a chat completion, ``token_ids`` in the choice
and ``prompt_token_ids`` beside ``choices``.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from boosttune.serving.sampling import SamplingParams

MAX_STOP_STRINGS = 4
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default: clients that want greedy send temperature 0
_SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class APIError(Exception):
    """An error answered to the client as ``{"error": {...}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# --------------------------------------------------------------------------------------------
# Schemas (types only; ranges and semantics are checked in ``_common``).


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    return_token_ids: bool = False


class CompletionBody(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessageBody(_Strict):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionBody(_SamplingFields):
    messages: list[ChatMessageBody]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


# --------------------------------------------------------------------------------------------
# Validation.


@dataclass(frozen=True)
class ModelLimits:
    """What the served model accepts: its name, context, vocabulary and default answer length."""

    name: str
    context_length: int
    vocab_size: int
    default_max_tokens: int


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request, ready for the engine.

    Attributes:
        kind: "completion" or "chat" (decides the response objects).
        prompt_ids: the prompt's token ids (chat template applied for chat).
        max_tokens: tokens to generate at most.
        sampling: temperature / top-p / top-k / seed (temperature 0 = greedy).
        stop: stop strings (not included in the returned text).
        stream: answer with server-sent events.
        include_usage: streaming: send a final chunk with usage counts.
        return_token_ids: add the generated ids to the ``boosttune`` statistics.
    """

    kind: Literal["completion", "chat"]
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    return_token_ids: bool


_JSON_TYPES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "dict": "object"}


def _json_type(tag: str, plural: bool = False) -> str:
    """A pydantic union member's tag in JSON's words: ``list[list[int]]`` → "array of arrays of integers"."""
    if tag.startswith("list[") and tag.endswith("]"):
        return f"{'arrays' if plural else 'array'} of {_json_type(tag[5:-1], plural=True)}"
    name = _JSON_TYPES.get(tag, "object")  # a model (ContentPart) is an object
    return name + "s" if plural else name


def _json_type_of(value: Any) -> str:
    for t, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
                    (dict, "object")):
        if isinstance(value, t):
            return name
    return "null"


def _client_loc(err: dict, raw: Any) -> tuple[list[str | int], list[str], Any]:
    """Where a pydantic error is, as the client wrote the body: pydantic's ``loc`` also names the union
    member it tried (``("prompt", "str")``); those steps are not in the body and are returned apart,
    with the value found at the location."""
    path: list[str | int] = []
    tags: list[str] = []
    node = raw
    for i, part in enumerate(err["loc"]):
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif err["type"] == "missing" and i == len(err["loc"]) - 1:
            node = None  # the missing field itself
        else:
            tags.append(str(part))
            continue
        path.append(part)
    return path, tags, node


def _schema_error(e: ValidationError, raw: dict) -> APIError:
    """The error the client can act on: the deepest one (where the body got furthest into the schema),
    named by its path in the body; at a union that nothing matched, the JSON types it takes."""
    found = [(err, *_client_loc(err, raw)) for err in e.errors()]
    err, path, _, value = max(found, key=lambda f: len(f[1]))
    where = _path(path)
    param = str(path[0]) if path else None
    if err["type"] == "missing":
        return APIError(422, f"Missing required parameter: '{where}'.", param, "missing_required_parameter")
    members = [f[2][-1] for f in found if f[1] == path and f[2]]
    if len(members) > 1:
        expected = " or ".join(_json_type(m) for m in members)
        return APIError(422, f"Invalid type for '{where}': expected {expected}; got {_json_type_of(value)}.", param,
                        "invalid_type")
    # "a valid dictionary or instance of ContentPart" names a Python class: say what JSON it wants
    msg = "Input should be a JSON object" if err["type"] in ("model_type", "dict_type") else err["msg"]
    return APIError(422, f"Invalid type for '{where}': {msg}.", param, "invalid_type")


def _check(ok: bool, message: str, param: str, code: str = "invalid_value") -> None:
    if not ok:
        raise APIError(400, message, param, code)


def _common(body: _SamplingFields, limits: ModelLimits) -> tuple[SamplingParams, tuple[str, ...]]:
    """Model, sampling, n, stop and the unsupported OpenAI options shared by both endpoints."""
    if body.model != limits.name:
        raise APIError(404, f"The model '{body.model}' does not exist; this server serves '{limits.name}'.",
                       "model", "model_not_found")
    temperature = DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    top_k = 0 if body.top_k is None else body.top_k
    _check(0.0 <= temperature <= 2.0, f"temperature must be between 0 and 2 (0 = greedy), got {temperature}.", "temperature")
    _check(0.0 < top_p <= 1.0, f"top_p must be in (0, 1], got {top_p}.", "top_p")
    _check(top_k >= 0, f"top_k must be >= 0 (0 disables it), got {top_k}.", "top_k")
    n = 1 if body.n is None else body.n
    _check(n >= 1, f"n must be >= 1, got {n}.", "n")
    _check(n == 1, "n > 1 is not supported: this server returns one choice per request.", "n", "unsupported_parameter")
    if body.seed is not None:
        lo, hi = _SEED_RANGE
        _check(lo <= body.seed <= hi, f"seed must be a 64-bit integer, got {body.seed}.", "seed")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        _check(value is None or value == 0, f"{name} is not supported (only 0): penalties would change the "
               "model's distribution, which speculative decoding reproduces exactly.", name, "unsupported_parameter")
    _check(not body.logit_bias, "logit_bias is not supported.", "logit_bias", "unsupported_parameter")
    stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    _check(len(stops) <= MAX_STOP_STRINGS, f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}.", "stop")
    _check(all(stops), "stop strings must not be empty.", "stop")
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=body.seed), stops


def _max_tokens(requested: int | None, field: str, default: int, prompt_len: int, limits: ModelLimits,
                prompt_param: str) -> int:
    """``requested`` (sent as ``field``) checked against the room the prompt leaves, or the default."""
    room = limits.context_length - prompt_len
    _check(room >= 1, f"This model's maximum context length is {limits.context_length} tokens, but the prompt has "
           f"{prompt_len} tokens; shorten it.", prompt_param, "context_length_exceeded")
    if requested is None:
        return min(default, room)
    _check(requested >= 1, f"{field} must be >= 1, got {requested}.", field)
    _check(requested <= room, f"This model's maximum context length is {limits.context_length} tokens; the prompt "
           f"has {prompt_len} and {field} asks for {requested}: lower {field} to at most {room}.",
           field, "context_length_exceeded")
    return requested


def is_unicode(s: str) -> bool:
    """False if ``s`` holds a lone UTF-16 surrogate (JSON's ``"\\ud800"`` decodes to one), which no
    tokenizer accepts and no UTF-8 response can echo."""
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _path(parts: list[str | int]) -> str:
    """``["messages", 0, "content"]`` → ``messages[0].content``, as the client wrote the body."""
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def _check_unicode(raw: dict) -> None:
    """Refuse (400, naming the field) a body with a lone surrogate in any key or string value."""
    stack: list[tuple[list[str | int], Any]] = [([], raw)]
    while stack:  # iterative: bodies nest as deep as json.loads allows
        path, value = stack.pop()
        if isinstance(value, str):
            bad = None if is_unicode(value) else path
        elif isinstance(value, dict):
            bad = next((path + [k] for k in value if not is_unicode(k)), None)
            stack.extend((path + [k], v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((path + [i], v) for i, v in enumerate(value))
            continue
        else:
            continue
        if bad is not None:
            shown = _path(bad).encode("utf-8", "backslashreplace").decode("utf-8")
            param = bad[0] if len(bad) > 1 or isinstance(value, str) else None
            raise APIError(400, f"'{shown}' holds a lone UTF-16 surrogate, which is not Unicode text: send "
                           "characters outside the BMP as a surrogate pair or as UTF-8.", param, "invalid_value")


class _Unconvertible:
    """Where the body held an integer too long for ``int()``: its digit count, found and named later."""

    def __init__(self, digits: int):
        self.digits = digits


def decode_json(data: bytes) -> Any:
    """A request body (bytes) → its JSON value, or a 400 :class:`APIError` naming what is wrong.

    Runs on the parsing thread: a 1 MB body takes milliseconds to decode, which the event loop must not
    spend. Integers too long for ``int()`` (it refuses more than ``sys.get_int_max_str_digits()`` digits,
    a guard against quadratic conversion) decode to a marker, so that the error can name their field.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise APIError(400, "The request body is not UTF-8 text.", None, "invalid_json") from None
    if not text.strip():
        raise APIError(400, "The request body is empty; send a JSON object.", None, "invalid_json")
    found: list[_Unconvertible] = []

    def parse_int(digits: str) -> int | _Unconvertible:
        try:
            return int(digits)
        except ValueError:  # only the digit limit: json hands over well-formed integers
            found.append(_Unconvertible(len(digits.lstrip("-"))))
            return found[-1]

    try:
        value = json.loads(text, parse_int=parse_int)
    except (json.JSONDecodeError, RecursionError) as e:
        raise APIError(400, f"Could not parse the request body as JSON: {e}.", None, "invalid_json") from None
    if found:
        _refuse_unconvertible(value)
    return value


def _refuse_unconvertible(raw: Any) -> None:
    """Raise the 400 for the first :class:`_Unconvertible` in ``raw``, naming its field."""
    stack: list[tuple[list[str | int], Any]] = [([], raw)]
    while stack:  # iterative, as in _check_unicode
        path, value = stack.pop()
        if isinstance(value, _Unconvertible):
            break
        if isinstance(value, dict):
            stack.extend((path + [k], v) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((path + [i], v) for i, v in reversed(list(enumerate(value))))
    else:
        raise AssertionError("decode_json found an unconvertible integer that is not in the body")
    where = "the request body" if not path else "'" + _path(path).encode("utf-8", "backslashreplace").decode() + "'"
    param = path[0] if path and isinstance(path[0], str) and is_unicode(path[0]) else None
    raise APIError(400, f"{where} holds an integer of {value.digits} digits, more than this server converts "
                   f"({sys.get_int_max_str_digits()}); send a shorter number.", param, "invalid_value")


def _validate(model: type[_Strict], raw: Any) -> Any:
    if not isinstance(raw, dict):
        raise APIError(400, f"The request body must be a JSON object, got {type(raw).__name__}.", None, "invalid_json")
    _check_unicode(raw)
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise _schema_error(e, raw) from None


def _completion_prompt(body: CompletionBody, tokenizer, limits: ModelLimits) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        _check(len(prompt) == 1, f"Batched prompts are not supported (got {len(prompt)}); send one request per prompt.",
               "prompt", "unsupported_parameter")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = list(tokenizer(prompt)["input_ids"])
    else:
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        _check(not bad, f"prompt token ids must be in [0, {limits.vocab_size}), got {bad[:3]}.", "prompt")
    _check(len(ids) > 0, "prompt must not be empty.", "prompt")
    return ids


def parse_completion(raw: Any, tokenizer, limits: ModelLimits) -> GenerationRequest:
    """A /v1/completions body (already JSON-decoded) → a validated request, or an :class:`APIError`."""
    body = _validate(CompletionBody, raw)
    sampling, stops = _common(body, limits)
    _check(not body.echo, "echo is not supported.", "echo", "unsupported_parameter")
    _check(body.logprobs is None, "logprobs is not supported.", "logprobs", "unsupported_parameter")
    _check(body.best_of in (None, 1), "best_of > 1 is not supported.", "best_of", "unsupported_parameter")
    _check(not body.suffix, "suffix is not supported.", "suffix", "unsupported_parameter")
    ids = _completion_prompt(body, tokenizer, limits)
    max_tokens = _max_tokens(body.max_tokens, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS, len(ids), limits, "prompt")
    return GenerationRequest(
        kind="completion", prompt_ids=ids, max_tokens=max_tokens, sampling=sampling, stop=stops,
        stream=bool(body.stream), include_usage=bool(body.stream_options and body.stream_options.include_usage),
        return_token_ids=body.return_token_ids,
    )


def _message_text(msg: ChatMessageBody, i: int) -> str:
    if msg.content is None or isinstance(msg.content, str):
        return msg.content or ""
    parts = []
    for j, part in enumerate(msg.content):
        _check(part.type == "text", f"messages[{i}].content[{j}]: only text parts are supported, got type "
               f"{part.type!r}.", "messages", "unsupported_parameter")
        if part.text is None:
            raise APIError(422, f"Missing required parameter: 'messages[{i}].content[{j}].text' (a text part holds "
                           "its text there).", "messages", "missing_required_parameter")
        parts.append(part.text)
    return "".join(parts)


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation through the tokenizer's chat template, with the assistant's turn opened."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(out["input_ids"])  # transformers 5 returns a BatchEncoding


def parse_chat(raw: Any, tokenizer, limits: ModelLimits) -> GenerationRequest:
    """A /v1/chat/completions body (already JSON-decoded) → a validated request, or an :class:`APIError`."""
    body = _validate(ChatCompletionBody, raw)
    sampling, stops = _common(body, limits)
    _check(not body.logprobs, "logprobs is not supported.", "logprobs", "unsupported_parameter")
    _check(not body.tools, "tools are not supported.", "tools", "unsupported_parameter")
    fmt = (body.response_format or {}).get("type", "text")
    _check(fmt == "text", f"response_format {fmt!r} is not supported (only 'text').", "response_format",
           "unsupported_parameter")
    _check(len(body.messages) > 0, "messages must hold at least one message.", "messages")
    messages = []
    for i, msg in enumerate(body.messages):
        _check(msg.role in _ROLES, f"messages[{i}].role {msg.role!r} is not supported; use one of "
               f"{sorted(_ROLES)}.", "messages")
        messages.append({"role": _ROLES[msg.role], "content": _message_text(msg, i)})
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "This model's tokenizer has no chat template; use /v1/completions.", "messages")
    try:
        ids = chat_prompt_ids(tokenizer, messages)
    except Exception as e:  # the template may raise (e.g. roles that must alternate): the client's to fix
        raise APIError(400, f"The chat template refused these messages: {e}", "messages") from None
    # OpenAI's newer name wins when a client sends both
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = _max_tokens(getattr(body, field), field, limits.default_max_tokens, len(ids), limits, "messages")
    return GenerationRequest(
        kind="chat", prompt_ids=ids, max_tokens=max_tokens, sampling=sampling, stop=stops,
        stream=bool(body.stream), include_usage=bool(body.stream_options and body.stream_options.include_usage),
        return_token_ids=body.return_token_ids,
    )


# --------------------------------------------------------------------------------------------
# Responses.


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response_body(kind: str, rid: str, model: str, text: str, finish_reason: str, usage_: dict, stats: dict,
                  token_ids: tuple[list[int], list[int]] | None = None) -> dict:
    """A whole (non-streamed) completion or chat completion; ``token_ids`` = (prompt ids, generated ids)
    when the request asked for them (``return_token_ids``, laid out as vLLM does)."""
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage_, "boosttune": stats}
    if token_ids is not None:
        prompt_ids, output_ids = token_ids
        choice["token_ids"] = list(output_ids)
        if kind == "chat":
            body["prompt_token_ids"] = list(prompt_ids)
        else:
            choice["prompt_token_ids"] = list(prompt_ids)
    return body


def chunk_body(kind: str, rid: str, model: str, text: str | None, finish_reason: str | None = None,
               first: bool = False, stats: dict | None = None) -> dict:
    """One streamed chunk; ``text=None`` sends an empty delta (the chat role chunk or the final one)."""
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}
    if stats is not None:
        body["boosttune"] = stats
    return body


def usage_chunk(kind: str, rid: str, model: str, usage_: dict) -> dict:
    """The extra last chunk sent when ``stream_options.include_usage`` is set (empty choices)."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [], "usage": usage_}
