"""Request bodies of `edge0 serve`, checked field by field into a GenRequest.

Every field a request may carry is listed here. Any other field is a 400 naming it, and so is a known field
with a value this server does not implement (`n` > 1, `echo`, tools...): nothing a client asks for is
silently ignored. Neutral values (`n: 1`, `echo: false`, `tools: []`, `logprobs: false`...) pass, since some
clients send them on every request. Numbers are checked for type and range before anything runs.
"""

from __future__ import annotations

import math
import re

from ..errors import ContextExceeded, Edge0Error
from ..config.checks import not_utf8
from ..decode.request import GenRequest
from .jobs import ApiError

# Bookkeeping fields with no effect on the answer: accepted (type-checked) and ignored.
IGNORED = {"user": str, "metadata": dict, "store": bool, "service_tier": str, "safety_identifier": str,
           "prompt_cache_key": str}
SHARED = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
          "stream_options", "n", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "ignore_eos",
          *IGNORED}
CHAT_FIELDS = SHARED | {"messages", "top_logprobs", "tools", "tool_choice", "functions", "function_call",
                        "parallel_tool_calls", "response_format"}
COMPLETION_FIELDS = SHARED | {"prompt", "echo", "suffix", "best_of"}

# Roles the chat templates take; "developer" is OpenAI's newer name for "system" and is sent as one.
ROLES = ("system", "user", "assistant", "tool", "developer")
MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id"}
MAX_STOPS = 16
MAX_SEED = 2**64 - 1  # the generator's seed is an unsigned 64-bit integer
TEMP_RANGE = (0.0, 2.0)  # OpenAI's range
PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's range of presence_penalty and frequency_penalty
BIAS_RANGE = (-100.0, 100.0)  # OpenAI's range of a logit_bias value
MAX_BIASES = 1024  # token ids in one logit_bias
TOKEN_ID = re.compile(r"[0-9]{1,10}")  # a logit_bias key; no longer than any vocabulary needs (int() of 5,000 raises)


def show(value) -> str:
    """A short rendering of a request value for an error message (never the whole of a huge one)."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    text = repr(value[:40] if isinstance(value, str) else value)
    return text if len(text) <= 40 else text[:37] + "..."


def number(body: dict, name: str, kind, default, lo=None, hi=None, *, lo_open: bool = False, where: str = ""):
    """body[name] as `kind` (int or float) within [lo, hi] ((lo, hi] if lo_open); null is as absent. where: the
    enclosing field's name and a dot, for a value inside an object (logit_bias)."""
    value = body.get(name)
    if value is None:
        return default
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or (isinstance(value, float) and not math.isfinite(value))
            or (kind is int and isinstance(value, float) and not value.is_integer())):
        raise ApiError(400, f"'{where}{name}': expected {'an integer' if kind is int else 'a number'}, got "
                            f"{show(value)}", "invalid_value", param=where.rstrip(".") or name)
    if (lo is not None and (value <= lo if lo_open else value < lo)) or (hi is not None and value > hi):
        span = f"{'(' if lo_open else '['}{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise ApiError(400, f"'{where}{name}': {show(value)} is out of range {span}", "invalid_value",
                       param=where.rstrip(".") or name)
    return kind(value)


def flag(body: dict, name: str, default: bool = False, *, where: str = "") -> bool:
    """body[name] as a bool; null is as absent. where: the enclosing field's name and a dot, for messages."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"'{where}{name}': expected true or false, got {show(value)}", "invalid_value",
                       param=where + name)
    return value


def _unsupported(name: str, why: str) -> ApiError:
    return ApiError(400, f"'{name}': {why}", "unsupported_value", param=name)


def check_completion_fields(body: dict, *, chat: bool) -> None:
    """Unknown fields, then known fields asking for what this server does not do."""
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = [k for k in body if k not in known]
    if unknown:
        names = ", ".join(show(k) for k in unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        route = "/v1/chat/completions" if chat else "/v1/completions"
        raise ApiError(400, f"{names}: not a field of {route}", "unknown_parameter", param=str(unknown[0])[:40])
    for name, kind in IGNORED.items():
        if body.get(name) is not None and not isinstance(body[name], kind):
            what = {str: "a string", dict: "an object", bool: "true or false"}[kind]
            raise ApiError(400, f"'{name}': expected {what}, got {show(body[name])}", "invalid_value", param=name)
    if number(body, "n", int, 1, 1, 128) != 1:
        raise _unsupported("n", "only 1 choice per request is supported")
    check_logprobs(body, chat=chat)
    if chat:
        _check_tools(body)
    else:
        if number(body, "best_of", int, 1, 1, 20) != 1:
            raise _unsupported("best_of", "only 1 is supported")
        if flag(body, "echo"):
            raise _unsupported("echo", "not supported")
        suffix = body.get("suffix")
        if suffix is not None and not isinstance(suffix, str):
            raise ApiError(400, f"'suffix': expected a string, got {show(suffix)}", "invalid_value", param="suffix")
        if suffix:
            raise _unsupported("suffix", "not supported (no fill-in-the-middle)")


def check_logprobs(body: dict, *, chat: bool) -> bool:
    """Whether log-probabilities are asked for, their values checked (chat: a flag and top_logprobs 0..20;
    completions: an integer 0..5). The engine does not compute them yet, so asking is a 400."""
    if chat:
        wanted = flag(body, "logprobs")
        top = number(body, "top_logprobs", int, None, 0, 20)
        if top is not None and not wanted:
            raise ApiError(400, "'top_logprobs': needs 'logprobs': true", "invalid_value", param="top_logprobs")
    else:
        wanted = number(body, "logprobs", int, None, 0, 5) is not None
    if wanted:
        raise _unsupported("logprobs", "not supported yet")
    return wanted


def _check_tools(body: dict) -> None:
    for name in ("tools", "functions"):
        value = body.get(name)
        if value is not None and not isinstance(value, list):
            raise ApiError(400, f"'{name}': expected a list, got {show(value)}", "invalid_value", param=name)
        if value:
            raise _unsupported(name, "not supported (this server does not call tools)")
    for name in ("tool_choice", "function_call"):
        value = body.get(name)
        if value not in (None, "none", "auto"):  # with no tools, "auto" is "none"
            raise _unsupported(name, f"{show(value)} is not supported (no tools); use \"none\" or \"auto\"")
    flag(body, "parallel_tool_calls")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str)):
        raise ApiError(400, "'response_format': expected an object with a 'type' string", "invalid_value",
                       param="response_format")
    if fmt is not None and fmt["type"] != "text":
        raise _unsupported("response_format", f"type {show(fmt['type'])} is not supported (only \"text\")")


# -- prompts ----------------------------------------------------------------------------------------


def text_value(text: str, param: str) -> str:
    """text, refused where it is not Unicode text: JSON may carry a lone surrogate (\\ud800), which the tokenizer
    raises on."""
    bad = not_utf8(text)
    if bad is not None:
        raise ApiError(400, f"'{param}': a lone surrogate at byte {bad} is not text", "invalid_value", param=param)
    return text


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return text_value(content, f"messages[{i}].content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}]: text parts only
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(parts) == len(content) and all(isinstance(t, str) for t in parts):
            return text_value("".join(parts), f"messages[{i}].content")
    raise ApiError(400, f"'messages[{i}].content': expected a string or a list of text parts", "invalid_value",
                   param=f"messages[{i}].content")


def _message(m, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise ApiError(400, f"'{where}': expected an object with 'role' and 'content', got {show(m)}",
                       "invalid_value", param=where)
    role = m.get("role")
    if not isinstance(role, str):
        raise ApiError(400, f"'{where}.role': required, a string", "invalid_value", param=f"{where}.role")
    if role not in ROLES:
        raise ApiError(400, f"'{where}.role': unknown role {show(role)} (expected {', '.join(ROLES)})",
                       "invalid_value", param=f"{where}.role")
    extra = [k for k in m if k not in MESSAGE_FIELDS]
    if extra:
        raise ApiError(400, f"'{where}.{str(extra[0])[:40]}': not a field of a message", "unknown_parameter",
                       param=where)
    for name in ("name", "tool_call_id"):
        if m.get(name) is not None and not isinstance(m[name], str):
            raise ApiError(400, f"'{where}.{name}': expected a string", "invalid_value", param=f"{where}.{name}")
    calls = m.get("tool_calls")
    if calls is not None and (role != "assistant" or not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls)):
        raise ApiError(400, f"'{where}.tool_calls': expected a list of {{function}} objects in an assistant message",
                       "invalid_value", param=f"{where}.tool_calls")
    for path, text in _strings(calls or [], f"{where}.tool_calls"):  # the chat template may render any of them
        text_value(text, path)
    if m.get("content") is None and not calls:
        need = "required" + (" (or tool_calls)" if role == "assistant" else "")
        raise ApiError(400, f"'{where}.content': {need} in a message of role '{role}'", "missing_field",
                       param=f"{where}.content")
    out = {"role": "system" if role == "developer" else role, "content": _content(m, i)}
    if calls:
        out["tool_calls"] = calls
    return out


def _strings(value, where: str):
    """(path, string) of every string in a JSON value, keys included; a loop, not recursion (any depth parses)."""
    todo = [(where, value)]
    while todo:
        at, v = todo.pop()
        if isinstance(v, str):
            yield at, v
        elif isinstance(v, dict):
            todo += [(at, str(k)) for k in v] + [(f"{at}.{k}", x) for k, x in v.items()]
        elif isinstance(v, list):
            todo += [(f"{at}[{j}]", x) for j, x in enumerate(v)]


def chat_prompt(engine, body: dict) -> list[int]:
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "'messages': required, a non-empty list of {role, content}", "missing_field",
                       param="messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, f"'messages': expected a non-empty list of {{role, content}}, got {show(messages)}",
                       "invalid_value", param="messages")
    msgs = [_message(m, i) for i, m in enumerate(messages)]
    try:
        return engine.encode_chat(msgs)
    except Exception as e:  # the model's template refused the conversation
        raise ApiError(400, f"'messages': the chat template failed: {e}", "invalid_value", param="messages") from None


def completion_prompt(engine, body: dict) -> list[int]:
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(400, "'prompt': required", "missing_field", param="prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return engine.encode_text(text_value(prompt, "prompt"))
    if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise ApiError(400, "'prompt': expected a string, a list of token ids, or a list of one of these",
                       "invalid_value", param="prompt")
    vocab = engine.vocab
    bad = next((t for t in prompt if t < 0 or (vocab and t >= vocab)), None)
    if bad is not None:
        raise ApiError(400, f"'prompt': token id {show(bad)} is out of range [0, {vocab - 1 if vocab else 'inf'}]"
                       " (the model's vocabulary)", "invalid_value", param="prompt")
    return prompt


# -- the generation -----------------------------------------------------------------------------------


def gen_request(engine, body: dict, prompt: list[int], defaults: dict) -> GenRequest:
    """The GenRequest of a checked body. defaults: temp, top_p, top_k, seed, max_tokens and the penalties of the
    command line."""
    if not prompt:
        raise ApiError(400, "the prompt is empty", "invalid_value", param="prompt")
    context = engine.context
    room = max(context - len(prompt), 0) if context else defaults["max_tokens"]
    for name in ("max_tokens", "max_completion_tokens"):
        number(body, name, int, None, 1, context)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = number(body, name, int, min(defaults["max_tokens"], room) or 1, 1, context)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else ([] if stop is None else stop)
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOPS:
        raise ApiError(400, f"'stop': expected a string or a list of at most {MAX_STOPS} strings", "invalid_value",
                       param="stop")
    vocab = engine.vocab
    req = GenRequest(prompt=list(prompt), max_tokens=max_tokens,
                     temp=number(body, "temperature", float, defaults["temp"], *TEMP_RANGE),
                     top_p=number(body, "top_p", float, defaults["top_p"], 0, 1, lo_open=True),
                     top_k=number(body, "top_k", int, defaults.get("top_k", 0), 0, vocab or None),
                     seed=number(body, "seed", int, defaults["seed"], 0, MAX_SEED), stop=stop,
                     ignore_eos=flag(body, "ignore_eos"),
                     presence_penalty=number(body, "presence_penalty", float, defaults.get("presence_penalty", 0.0),
                                             *PENALTY_RANGE),
                     frequency_penalty=number(body, "frequency_penalty", float,
                                              defaults.get("frequency_penalty", 0.0), *PENALTY_RANGE),
                     logit_bias=logit_bias(body, engine.vocab))
    where = "messages" if "messages" in body else "prompt"
    try:
        engine.check(req)
    except ContextExceeded as e:
        raise ApiError(400, str(e), "context_length_exceeded", param=where) from None
    except Edge0Error as e:
        raise ApiError(400, str(e), "invalid_value", param=where) from None
    return req


def logit_bias(body: dict, vocab: int | None) -> dict[int, float] | None:
    """OpenAI's logit_bias: {token id (a string of digits): bias in [-100, 100]}, at most MAX_BIASES of them."""
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict) or len(bias) > MAX_BIASES:
        raise ApiError(400, f"'logit_bias': expected an object of at most {MAX_BIASES} token ids, got {show(bias)}",
                       "invalid_value", param="logit_bias")
    out = {}
    for key, value in bias.items():
        # ASCII digits only: str.isdigit() is true of '²' (int() raises) and '١' (int() reads 1)
        if not (isinstance(key, str) and TOKEN_ID.fullmatch(key) and (vocab is None or int(key) < vocab)):
            raise ApiError(400, f"'logit_bias': {show(key)} is not a token id (0 to {(vocab or 0) - 1})",
                           "invalid_value", param="logit_bias")
        out[int(key)] = number(bias, key, float, 0.0, *BIAS_RANGE, where="logit_bias.")
    return out or None


def stream_flags(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = flag(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise ApiError(400, f"'stream_options': expected an object, got {show(opts)}", "invalid_value",
                       param="stream_options")
    usage = flag(opts or {}, "include_usage", where="stream_options.")
    return stream, usage
