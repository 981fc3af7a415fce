"""Request files as users write them: our plain JSONL, or OpenAI's Batch API JSONL.

Plain: {"prompt_token_ids": [...]} or {"prompt": "text"} per line, with max_tokens, temperature,
top_p, seed and stop of its own if it likes (--gen-len the default and the cap), nothing else.
OpenAI (what vLLM's run-batch also reads): {"custom_id", "method": "POST", "url", "body"} per
line, `url` /v1/chat/completions (body `messages`, rendered with the checkpoint's chat template)
or /v1/completions (body `prompt`, text or token ids). A file is one format or the other, told
by each line's keys. Body fields that change the answer and are not run here are refused up
front, naming the line and the field; `answer_line` writes OpenAI's batch output line. Every
message names a file's request by its line, 1-based as editors show it, and the Python API's by
its list subscript (`locate`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hrm.errors import HrmError
from hrm.io import read_text

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
API = "requests"  # where the Python API's requests come from: request n is requests[n - 1]
FINISH_REASONS = ("stop", "length")
_OPENAI_KEYS = {"custom_id", "method", "url", "body"}
_PLAIN_KEYS = {"prompt_token_ids", "prompt"}
# a request's own limits, in a plain line, a Python API request and an OpenAI body alike
_PER_REQUEST = {"max_tokens", "temperature", "top_p", "seed", "stop"}
ROLES = ("system", "user", "assistant", "tool", "developer")  # what chat templates render
# body fields that change nothing here, with the values that keep it so (None: any value)
_INERT = {"model": None, "user": None, "metadata": None, "store": None, "n": (1,),
          "stream": (False,), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
          "logprobs": (False,), "echo": (False,), "service_tier": None}  # fmt: skip
_HONOURED = {"messages", "prompt", "max_completion_tokens", "return_token_ids", *_PER_REQUEST}


@dataclass(frozen=True, kw_only=True)
class Request:
    """One line of a request file: what to generate from, and its own limits (None: the run's)."""

    line: int
    prompt: list[int] | str | None = None  # token ids or text (plain and completions)
    messages: tuple[Mapping[str, Any], ...] | None = None  # chat: rendered by the chat template
    custom_id: str | None = None  # OpenAI's; None in the plain format
    endpoint: str | None = None  # "chat" or "completion"; None in the plain format
    model: str | None = None  # the body's, echoed in the answer
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()  # strings that end the answer (not returned)
    return_token_ids: bool = False  # OpenAI: the answer's (and prompt's) token ids in it (vLLM's)

    @property
    def openai(self) -> bool:
        return self.endpoint is not None


def read_requests(path: Path) -> list[Request]:
    """Every line of a request file, checked; output line i answers input line i, so a blank
    line inside the file is refused (trailing ones end it)."""
    # lines as editors count them: "\n" ends one (str.splitlines would also cut at U+2028)
    lines = [line.removesuffix("\r") for line in read_text(path, "prompts file").split("\n")]
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise HrmError(f"{path}: no prompts in the file")
    requests = [_request(line, n, f"{path}:{n}") for n, line in enumerate(lines, 1)]
    first = requests[0].openai
    mixed = next((r for r in requests if r.openai != first), None)
    if mixed is not None:
        kinds = ("OpenAI batch", "plain") if first else ("plain", "OpenAI batch")
        raise HrmError(
            f"{path}:{mixed.line}: a {kinds[1]} line in a file of {kinds[0]} lines; use one "
            "format per file"
        )
    seen: dict[str, int] = {}
    for r in requests:
        if r.custom_id in seen:
            raise HrmError(
                f"{path}:{r.line}: custom_id {r.custom_id!r} repeats line {seen[r.custom_id]}'s; "
                "each request needs its own"
            )
        if r.custom_id is not None:
            seen[r.custom_id] = r.line
    return requests


def _request(line: str, n: int, where: str) -> Request:
    if not line.strip():
        raise HrmError(
            f"{where}: a blank line; output line i answers input line i, so remove it or give "
            "it a prompt"
        )
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        raise HrmError(f"{where}: not a JSON object; one request per line") from None
    if isinstance(record, dict) and record.keys() & _OPENAI_KEYS:
        return _openai(record, n, where)
    if not isinstance(record, dict) or len(record.keys() & _PLAIN_KEYS) != 1:
        raise HrmError(
            f"{where}: give exactly one of 'prompt_token_ids' or 'prompt', or an OpenAI batch "
            "request (custom_id, method, url, body)"
        )
    extra = sorted(record.keys() - _PLAIN_KEYS - _PER_REQUEST)
    if extra:
        raise HrmError(
            f"{where}: {extra[0]!r} is not supported in a plain line (it takes "
            f"{', '.join(sorted(_PLAIN_KEYS))} and {', '.join(sorted(_PER_REQUEST))}); remove it"
        )
    limits = _limits(record, where, at="")
    if "prompt" in record:
        return Request(line=n, prompt=_text(record["prompt"], "'prompt'", where), **limits)
    ids = _ids(record["prompt_token_ids"], "'prompt_token_ids'", where)
    return Request(line=n, prompt=ids, **limits)


def _openai(record: dict, n: int, where: str) -> Request:
    missing = sorted(_OPENAI_KEYS - record.keys())
    if missing:
        raise HrmError(f"{where}: an OpenAI batch request needs {', '.join(missing)}")
    custom_id, body = record["custom_id"], record["body"]
    if not isinstance(custom_id, str) or not custom_id:
        raise HrmError(f"{where}: custom_id must be a non-empty string")
    if record["method"] != "POST":
        raise HrmError(f"{where}: method {record['method']!r} is not supported; use POST")
    endpoint = ENDPOINTS.get(record["url"])
    if endpoint is None:
        raise HrmError(
            f"{where}: url {record['url']!r} is not supported; use {' or '.join(ENDPOINTS)}"
        )
    if not isinstance(body, dict):
        raise HrmError(f"{where}: body must be a JSON object")
    _check_body(body, where)
    limits = _limits(body, where)
    wants_ids = body.get("return_token_ids")
    if wants_ids is not None and not isinstance(wants_ids, bool):
        raise HrmError(f"{where}: body.return_token_ids must be true or false, got {wants_ids!r}")
    limits["return_token_ids"] = bool(wants_ids)
    if endpoint == "chat":
        if "messages" not in body:
            raise HrmError(f"{where}: a chat completion needs body.messages")
        return Request(line=n, custom_id=custom_id, endpoint=endpoint,
                       messages=_messages(body["messages"], where), **limits)  # fmt: skip
    if "prompt" not in body:
        raise HrmError(f"{where}: a completion needs body.prompt")
    prompt = _ids_or_text(body["prompt"], "body.prompt", where)
    return Request(line=n, custom_id=custom_id, endpoint=endpoint, prompt=prompt, **limits)


def _check_body(body: dict, where: str) -> None:
    """Every field either honoured, or one that changes nothing at the value given."""
    for key, value in body.items():
        if key in _HONOURED:
            continue
        if key not in _INERT:
            raise HrmError(f"{where}: body.{key} is not supported here; remove it")
        allowed = _INERT[key]
        if allowed is not None and value not in allowed and value is not None:
            raise HrmError(
                f"{where}: body.{key} {json.dumps(value)} is not supported here; "
                f"use {json.dumps(allowed[0])} or remove it"
            )


def _limits(body: dict, where: str, at: str = "body.") -> dict[str, Any]:
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise HrmError(f"{where}: give max_tokens or max_completion_tokens, not both")
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = body.get(key)
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise HrmError(f"{where}: {at}{key} must be a positive integer, got {max_tokens!r}")
    temperature, top_p, seed = body.get("temperature"), body.get("top_p"), body.get("seed")
    if temperature is not None and (not _is_number(temperature) or not temperature >= 0):
        raise HrmError(f"{where}: {at}temperature must be 0 or positive, got {temperature!r}")
    if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
        raise HrmError(f"{where}: {at}top_p must be in (0, 1], got {top_p!r}")
    if seed is not None and not _is_int(seed):
        raise HrmError(f"{where}: {at}seed must be an integer, got {seed!r}")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise HrmError(f"{where}: {at}stop must be a string or a list of non-empty strings")
    model = body.get("model")
    return dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                stop=tuple(stop), model=model if isinstance(model, str) else None)  # fmt: skip


def _messages(messages: Any, where: str, at: str = "body.") -> tuple[dict[str, Any], ...]:
    """Chat messages as the template takes them: a role and text content (a string, or a list
    of text parts, joined)."""
    if not isinstance(messages, list) or not messages:
        raise HrmError(f"{where}: {at}messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise HrmError(f"{where}: {at}messages[{i}] needs a role")
        if m["role"] not in ROLES:
            raise HrmError(
                f"{where}: {at}messages[{i}].role {m['role']!r} is not a chat role; use one of "
                f"{', '.join(ROLES)}"
            )
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise HrmError(f"{where}: {at}messages[{i}]: only text content is supported")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise HrmError(f"{where}: {at}messages[{i}].content must be text")
        extra = sorted(m.keys() - {"role", "content", "name"})
        if extra:
            raise HrmError(f"{where}: {at}messages[{i}].{extra[0]} is not supported here")
        out.append({**m, "content": content})
    return tuple(out)


def _text(value: Any, what: str, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise HrmError(f"{where}: {what} must be a non-empty string")
    return value


def _ids(value: Any, what: str, where: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(_is_int(t) for t in value):
        raise HrmError(f"{where}: {what} must be a non-empty list of ints")
    return value


def _ids_or_text(value: Any, what: str, where: str, *, ids_only: bool = False):
    """A prompt given as token ids (a list) or as text."""
    if ids_only or isinstance(value, list):
        return _ids(value, what, where)
    return _text(value, what, where)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def locate(source, line: int) -> str:
    """Where a request is, for every message that names one: FILE:LINE (1-based, as editors
    number lines), or requests[i] for the Python API's (the list's own subscript)."""
    return f"{API}[{line - 1}]" if str(source) == API else f"{source}:{line}"


def requests_from(items: Sequence[Any], where: str = API) -> list[Request]:
    """The Python API's requests (hrm.api.generate): each a text prompt, a list of token ids, or a
    dict of one of prompt, prompt_token_ids or messages, with max_tokens, temperature, top_p,
    seed and stop of its own; line n is items[n - 1]."""
    if isinstance(items, str | bytes) or not isinstance(items, Sequence) or not items:
        raise HrmError(f"{where}: give a non-empty list of prompts")
    out = []
    for n, item in enumerate(items, 1):
        at = locate(where, n)
        if isinstance(item, str):
            out.append(Request(line=n, prompt=_text(item, "the prompt", at)))
        elif isinstance(item, list):
            out.append(Request(line=n, prompt=_ids(item, "the prompt", at)))
        elif isinstance(item, Mapping):
            out.append(_api_request(dict(item), n, at))
        else:
            raise HrmError(
                f"{at}: a prompt is text, token ids or a dict, not {type(item).__name__}"
            )
    return out


def _api_request(item: dict, n: int, at: str) -> Request:
    given = sorted(item.keys() & {"prompt", "prompt_token_ids", "messages"})
    if len(given) != 1:
        raise HrmError(f"{at}: give exactly one of prompt, prompt_token_ids or messages")
    extra = sorted(item.keys() - {*given, *_PER_REQUEST})
    if extra:
        raise HrmError(f"{at}: {extra[0]} is not supported here; remove it")
    limits = _limits(item, at, at="")
    key = given[0]
    if key == "messages":
        return Request(line=n, messages=_messages(item[key], at, at=""), **limits)
    prompt = _ids_or_text(item[key], key, at, ids_only=key == "prompt_token_ids")
    return Request(line=n, prompt=prompt, **limits)


def answer_lengths(requests: list[Request], gen_len: int | None, path) -> list[int]:
    """Each request's most new tokens: its max_tokens capped at gen_len (--gen-len, a default and
    a cap), else gen_len; without gen_len every request needs its own."""
    if gen_len is None:
        missing = next((r for r in requests if r.max_tokens is None), None)
        if missing is not None:
            raise HrmError(
                f"{locate(path, missing.line)}: no max_tokens, and no --gen-len for it; give one "
                "or the other"
            )
        return [r.max_tokens for r in requests]
    return [answer_length(r, gen_len) for r in requests]


def answer_length(request: Request | None, gen_len: int) -> int:
    """A request's most new tokens: its max_tokens capped at gen_len, else gen_len (a random
    prompt, request None, takes gen_len)."""
    given = request.max_tokens if request is not None else None
    return gen_len if given is None else min(given, gen_len)


def prompt_ids(request: Request, tokenizer, where, path) -> list[int]:
    """A request's prompt as token ids: given, tokenized, or its chat rendered by the
    checkpoint's chat template with the generation prompt (as transformers renders it)."""
    at = locate(path, request.line)
    if isinstance(request.prompt, list):
        ids = request.prompt
    elif tokenizer is None and request.messages is not None:
        raise HrmError(
            f"{at}: chat messages, but {where} has no tokenizer to render them; send "
            "/v1/completions requests with token ids as the prompt instead"
        )
    elif tokenizer is None:
        raise HrmError(f"{at}: a text prompt, but {where} has no tokenizer; give token ids instead")
    elif request.messages is None:
        ids = tokenizer(request.prompt)["input_ids"]
    elif not getattr(tokenizer, "chat_template", None):
        raise HrmError(
            f"{at}: chat messages, but {where}'s tokenizer has no chat template; use "
            "/v1/completions with a prompt instead"
        )
    else:
        rendered = tokenizer.apply_chat_template(
            list(request.messages), add_generation_prompt=True, tokenize=True, return_dict=True
        )
        ids = list(rendered["input_ids"])
    return ids


def answer_line(
    request: Request,
    index: int,
    *,
    text: str | None,
    token_ids: list[int],
    prompt_token_ids: Sequence[int],
    finish_reason: str,
    model: str,
    created: int,
) -> dict[str, Any]:
    """OpenAI's batch output line for one request (what vLLM's run-batch writes). Asked with
    return_token_ids, or where there is no text (no tokenizer), the choice carries the answer's
    `token_ids` as vLLM's does, so that nothing is lost; asked, the prompt's ids too."""
    if request.endpoint == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text or ""},
                  "logprobs": None, "finish_reason": finish_reason}  # fmt: skip
        obj, prefix = "chat.completion", "chatcmpl"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj, prefix = "text_completion", "cmpl"
    if request.return_token_ids or text is None:
        choice["token_ids"] = list(token_ids)
    prompt_tokens, completion_tokens = len(prompt_token_ids), len(token_ids)
    body = {
        "id": f"{prefix}-{index}",
        "object": obj,
        "created": created,
        "model": request.model or model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
    if request.return_token_ids:  # vLLM: a completion's in its choice, a chat's in the body
        (choice if request.endpoint == "completion" else body)["prompt_token_ids"] = list(
            prompt_token_ids
        )
    return {
        "id": f"batch_req_{index}",
        "custom_id": request.custom_id,
        "response": {"status_code": 200, "request_id": f"req_{index}", "body": body},
        "error": None,
    }
