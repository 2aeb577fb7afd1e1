"""Reading an OpenAI-compatible server's reply: server-sent events or one JSON completion, into one `ServerReply`.

Pure functions of the bytes a server sent (no I/O), so that every hostile or broken reply can be tested without a
socket. What they guarantee, whatever the server does:

- **The stop string is found by the client.** Servers disagree on it: the OpenAI API and llama.cpp's server cut it
  off and say only `finish_reason: "stop"` (which an end-of-sequence token also gives), vLLM cuts it and names it in
  `stop_reason`, `transformers serve` keeps it. So the client does not ask the server to stop on our strings (except
  a server that keeps them on request, `tools.openai_server`): it finds the first stop string in the streamed text
  itself, cuts the text there, records which one it was, and the caller closes the stream.
- **The token limit holds on the client.** A server that ignores it (llama.cpp's server ignores
  `max_completion_tokens`) is cut once it sent more content chunks than the limit, or more than
  `MAX_CHARS_PER_TOKEN` characters a token, and the reply is flagged `cut_by_client="length"`.
- **Linear and bounded.** An event line is at most `MAX_EVENT_BYTES`; a JSON body at most `MAX_BODY_BYTES`; the stop
  search looks only at each new piece and the few characters before it.
- **A reply that is not a chat completion is a `ReplyShapeError`** naming what was wrong (`choices: []`, no
  `message`, `content: null`, a field of the wrong type), never an IndexError or KeyError.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

MAX_EVENT_BYTES = 4 * 1024 * 1024  # one server-sent event line
MAX_BODY_BYTES = 32 * 1024 * 1024  # a whole JSON reply, or an error body
MAX_CHARS_PER_TOKEN = 64  # no tokenizer's token is longer; a server past limit × this ignored the limit
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


class ReplyShapeError(ValueError):
    """A reply that is not a chat completion (or a stream of chunks of one). The message says what is wrong."""


class ReplyStreamError(RuntimeError):
    """The server reported an error inside its stream (`data: {"error": ...}`), after a 200."""


class ReplyCut(Exception):
    """The stream ended (or the connection closed) before the reply did."""


def check_stops(stop: Sequence[str] | None) -> tuple[str, ...]:
    """The stop strings as a tuple, checked: non-empty strings, a bounded number of bounded ones."""
    if stop is None:
        return ()
    if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop must be a list of non-empty strings, got {stop!r}"[:300])
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise ValueError(f"stop: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters each")
    return tuple(dict.fromkeys(stop))


class StopScanner:
    """Finds the first stop string in text that arrives in pieces, in time linear in the text.

    `feed` returns the part of the text that is safe to release (it cannot be the start of a stop string); the
    last `len(longest stop) - 1` characters wait in `pending` until the next piece or `flush`."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.keep = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.matched: str | None = None

    def feed(self, piece: str) -> str:
        if self.matched is not None:
            return ""
        window = self.pending + piece
        hits = [(index, stop) for stop in self.stops if (index := window.find(stop)) >= 0]
        if hits:
            index, self.matched = min(hits)  # the earliest; of two starting together, the shorter ends first
            self.pending = ""
            return window[:index]
        cut = max(0, len(window) - self.keep)
        self.pending = window[cut:]
        return window[:cut]

    def flush(self) -> str:
        rest, self.pending = self.pending, ""
        return rest


class EventDecoder:
    """Server-sent events from bytes in any split: `feed` returns the `data` payloads completed so far.

    Lines end in \\n, \\r\\n or \\r; an event ends at a blank line; its `data:` lines are joined with \\n. Other
    fields (event:, id:, retry:) and comments are skipped. A line longer than MAX_EVENT_BYTES is an error."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        payloads: list[str] = []
        start = 0
        while True:
            end = self._buffer.find(b"\n", start)
            if end < 0:
                break
            self._line(bytes(self._buffer[start:end]).rstrip(b"\r"), payloads)
            start = end + 1
        del self._buffer[:start]
        if len(self._buffer) > MAX_EVENT_BYTES:
            raise ReplyShapeError(f"a server-sent event line is longer than {MAX_EVENT_BYTES // 2**20} MB")
        return payloads

    def close(self) -> list[str]:
        """The payloads of an event the stream ended without a blank line after."""
        payloads: list[str] = []
        if self._buffer:
            self._line(bytes(self._buffer).rstrip(b"\r"), payloads)
            self._buffer.clear()
        self._line(b"", payloads)
        return payloads

    def _line(self, line: bytes, payloads: list[str]) -> None:
        if not line:
            if self._data:
                payloads.append("\n".join(self._data))
                self._data = []
            return
        if line.startswith(b"data:"):
            value = line[5:]
            self._data.append((value[1:] if value.startswith(b" ") else value).decode("utf-8", "replace"))


@dataclass
class ServerReply:
    """One reply as the client read it. `text` is cut before the stop string that ended it (`stop_sequence`);
    `cut_by_client` says what the client cut ("stop": a stop string the server did not stop at, "length": more
    than the token limit), None when the server ended the reply itself."""

    text: str
    finish_reason: str
    stop_sequence: str | None
    cut_by_client: str | None
    usage: dict[str, int]
    usage_counted: bool  # the server reported no usage: output tokens counted by the client, input tokens unknown
    logprobs: list[dict[str, Any]] | None
    server_stop_reason: str | int | None  # vLLM's own `stop_reason`, as reported
    model: str | None


@dataclass
class ReplyAssembler:
    """Builds a `ServerReply` from a stream's chunks (`add_chunk`) or a whole completion (`add_completion`).

    `done` turns true once the reply is complete from the client's side (a stop string, the token limit): the
    caller then stops reading and closes the connection, which makes vLLM, llama.cpp's and transformers' servers
    stop generating."""

    stops: Sequence[str]
    max_tokens: int
    released: list[str] = field(default_factory=list)
    chars: int = 0
    chunks: int = 0  # content-bearing chunks: one token each on every server we know (more tokens, never fewer)
    finish_reason: str | None = None
    cut_by_client: str | None = None
    server_stop_reason: str | int | None = None
    usage: dict[str, int] | None = None
    logprobs: list[dict[str, Any]] | None = None
    model: str | None = None
    saw_choice: bool = False
    saw_stop_reason_field: bool = False  # vLLM's signature: every choice of its replies carries `stop_reason`

    def __post_init__(self) -> None:
        self.scanner = StopScanner(self.stops)

    @property
    def done(self) -> bool:
        return self.cut_by_client is not None

    # -------------------------------------------------------------------------------------------- input

    def add_chunk(self, payload: str) -> str:
        """One `data:` payload of a stream; returns the text it releases (for a streaming caller)."""
        chunk = _json_object(payload, "a streamed chunk")
        self._common(chunk)
        choice = self._first_choice(chunk, allow_none=True)
        if choice is None:
            return ""
        if "text" in choice and "delta" not in choice:  # the completions endpoint (`prompt` in, `text` out)
            released = self._content(_optional_str(choice["text"], "choices[0].text"))
            self._choice_end(choice)
            return released
        delta = choice.get("delta")
        if delta is None:
            delta = {}
        if not isinstance(delta, dict):
            raise ReplyShapeError(f"choices[0].delta is a {type(delta).__name__}, not an object")
        released = self._content(_optional_str(delta.get("content"), "choices[0].delta.content"))
        self._choice_end(choice)
        return released

    def add_completion(self, body: dict[str, Any]) -> str:
        """A whole (non-streamed) chat completion, or a completion of the completions endpoint (`text`)."""
        self._common(body)
        choice = self._first_choice(body, allow_none=False)
        if "text" in choice and "message" not in choice:
            text = _optional_str(choice["text"], "choices[0].text")
            if text is None:
                raise ReplyShapeError("choices[0].text is null: the reply has no text")
            released = self._content(text)
            self._choice_end(choice)
            return released
        message = choice.get("message")
        if not isinstance(message, dict):
            raise ReplyShapeError(
                "choices[0] has no message object"
                if message is None
                else f"choices[0].message is a {type(message).__name__}, not an object"
            )
        content = _optional_str(message.get("content"), "choices[0].message.content")
        if content is None:
            raise ReplyShapeError("choices[0].message.content is null: the reply has no text")
        released = self._content(content)
        self._choice_end(choice)
        return released

    def _common(self, obj: dict[str, Any]) -> None:
        error = obj.get("error")
        if error is not None:
            message = error.get("message") if isinstance(error, dict) else error
            raise ReplyStreamError(" ".join(str(message).split())[:300])
        if isinstance(obj.get("model"), str):
            self.model = obj["model"][:200]
        usage = obj.get("usage")
        if isinstance(usage, dict):
            counts = {key: usage.get(key) for key in ("prompt_tokens", "completion_tokens")}
            if all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in counts.values()):
                self.usage = {
                    "input_tokens": counts["prompt_tokens"],
                    "output_tokens": counts["completion_tokens"],
                    "total_tokens": counts["prompt_tokens"] + counts["completion_tokens"],
                }

    def _first_choice(self, obj: dict[str, Any], allow_none: bool) -> dict[str, Any] | None:
        choices = obj.get("choices")
        if choices is None and allow_none and "usage" in obj:
            return None  # a usage-only chunk
        if not isinstance(choices, list):
            raise ReplyShapeError(
                "the reply has no choices list"
                if choices is None
                else f"choices is a {type(choices).__name__}, not a list"
            )
        if not choices:
            if allow_none:
                return None  # the usage chunk of `stream_options.include_usage` has `choices: []`
            raise ReplyShapeError("choices is empty: the reply has no completion")
        # Only the first completion is asked for (n=1); a server that sends others is not read further.
        choice = next((c for c in choices if isinstance(c, dict) and c.get("index", 0) == 0), choices[0])
        if not isinstance(choice, dict):
            raise ReplyShapeError(f"choices[0] is a {type(choice).__name__}, not an object")
        self.saw_choice = True
        return choice

    def _choice_end(self, choice: dict[str, Any]) -> None:
        if "stop_reason" in choice:
            self.saw_stop_reason_field = True
            reason = choice["stop_reason"]
            if isinstance(reason, (str, int)) and not isinstance(reason, bool):
                self.server_stop_reason = reason if not isinstance(reason, str) else reason[:MAX_STOP_CHARS]
        self._logprobs(choice.get("logprobs"))
        finish = _optional_str(choice.get("finish_reason"), "choices[0].finish_reason")
        if finish is not None and self.finish_reason is None:
            self.finish_reason = finish[:40]

    def _content(self, content: str | None) -> str:
        if not content or self.done:
            return ""
        self.chunks += 1
        if self.chunks > self.max_tokens:  # the server went past the limit it was given
            self.cut_by_client = "length"
            return ""
        room = self.max_tokens * MAX_CHARS_PER_TOKEN - self.chars
        self.chars += min(len(content), room)
        released = self.scanner.feed(content[:room])
        if self.scanner.matched is not None:
            self.cut_by_client = "stop"
        elif len(content) > room:
            released += self.scanner.flush()
            self.cut_by_client = "length"
        self.released.append(released)
        return released

    def _logprobs(self, logprobs: Any) -> None:
        entries = _logprob_entries(logprobs)
        if entries is None:
            return
        kept = self.logprobs if self.logprobs is not None else []
        for entry in entries[: max(0, self.max_tokens + 1 - len(kept))]:
            if _token_logprob(entry):
                kept.append({"token": entry["token"][: MAX_CHARS_PER_TOKEN * 4], "logprob": float(entry["logprob"])})
                top = entry.get("top_logprobs")
                if isinstance(top, list) and top:
                    kept[-1]["top_logprobs"] = [
                        {"token": t["token"][: MAX_CHARS_PER_TOKEN * 4], "logprob": float(t["logprob"])}
                        for t in top[:MAX_TOP_LOGPROBS]
                        if _token_logprob(t)
                    ]
        self.logprobs = kept

    # ------------------------------------------------------------------------------------------- output

    def finish(self, *, stream_closed_cleanly: bool) -> tuple[ServerReply, str]:
        """The reply, and the text still held back (to release to a streaming caller). `stream_closed_cleanly`:
        the server ended the stream itself ([DONE], or the body's end after a finish reason)."""
        if not self.saw_choice:
            raise ReplyShapeError("the reply had no choices: no completion came back")
        if not self.done and self.finish_reason is None:
            # Even after [DONE]: llama-cpp-python's server ends a stream that way when another request interrupts
            # it (its default), and the reply is then cut, not finished.
            raise ReplyCut(
                "the stream ended before the reply did (no finish_reason)"
                + (" although the server said [DONE]" if stream_closed_cleanly else "")
            )
        rest = self.scanner.flush() if self.scanner.matched is None else ""
        self.released.append(rest)
        stop_sequence = self.scanner.matched
        if stop_sequence is None and self.server_stop_reason in self.stops:
            stop_sequence = self.server_stop_reason  # vLLM cut it off and named it (without include_stop_str_in_output)
        finish_reason = (
            "stop" if stop_sequence else ("length" if self.cut_by_client == "length" else self.finish_reason or "stop")
        )
        counted = self.usage is None or self.done
        output_tokens = min(self.chunks, self.max_tokens)
        if self.logprobs:
            output_tokens = max(output_tokens, min(len(self.logprobs), self.max_tokens))
        if counted:
            input_tokens = self.usage["input_tokens"] if self.usage else 0
            usage = {
                "input_tokens": input_tokens,
                "output_tokens": output_tokens,
                "total_tokens": input_tokens + output_tokens,
            }
        else:
            usage = dict(self.usage)  # type: ignore[arg-type]
        if self.logprobs is not None and stop_sequence is None:
            self.logprobs = self.logprobs[: self.max_tokens]
        reply = ServerReply(
            text="".join(self.released),
            finish_reason=finish_reason,
            stop_sequence=stop_sequence,
            cut_by_client=self.cut_by_client,
            usage=usage,
            usage_counted=counted,
            logprobs=self.logprobs,
            server_stop_reason=self.server_stop_reason,
            model=self.model,
        )
        return reply, rest


def _json_object(text: str | bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as err:
        raise json.JSONDecodeError(f"{what} is not JSON ({err})"[:300], "", 0) from None
    if not isinstance(value, dict):
        raise ReplyShapeError(f"{what} is a JSON {type(value).__name__}, not an object")
    return value


def parse_completion_body(body: bytes) -> dict[str, Any]:
    """A whole JSON reply as an object (a JSONDecodeError or ReplyShapeError otherwise)."""
    return _json_object(body, "the reply")


def _optional_str(value: Any, name: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise ReplyShapeError(f"{name} is a {type(value).__name__}, not a string")


MAX_TOP_LOGPROBS = 20  # alternatives kept per token (the OpenAI API's maximum)


def _logprob_entries(logprobs: Any) -> list[Any] | None:
    """A choice's `logprobs` as chat-completion entries (`[{"token", "logprob", "top_logprobs": [...]}]`): the chat
    endpoint's `{"content": [...]}`, or the completions endpoint's parallel lists (`tokens`, `token_logprobs`,
    `top_logprobs` as `{token: logprob}` maps). None when it is neither (entries are checked one by one later)."""
    if not isinstance(logprobs, dict):
        return None
    if isinstance(logprobs.get("content"), list):
        return logprobs["content"]
    tokens, values = logprobs.get("tokens"), logprobs.get("token_logprobs")
    if not isinstance(tokens, list) or not isinstance(values, list):
        return None
    tops = logprobs.get("top_logprobs")
    tops = tops if isinstance(tops, list) else []
    entries = []
    for index, (token, value) in enumerate(zip(tokens, values)):
        top = tops[index] if index < len(tops) and isinstance(tops[index], dict) else {}
        alternatives = [{"token": t, "logprob": lp} for t, lp in list(top.items())[:MAX_TOP_LOGPROBS]]
        entries.append({"token": token, "logprob": value, "top_logprobs": alternatives})
    return entries


def _token_logprob(entry: Any) -> bool:
    """A `{"token": str, "logprob": finite number}` entry, as a server's logprobs are read (untrusted JSON)."""
    return isinstance(entry, dict) and isinstance(entry.get("token"), str) and _finite(entry.get("logprob"))


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def error_detail(body: bytes) -> str:
    """The server's own words from an error body: an OpenAI-style `error.message`, FastAPI's `detail`, or the
    text itself; one line, at most 300 characters."""
    text = body[:65536].decode("utf-8", "replace")
    try:
        value = json.loads(text)
    except ValueError:
        return " ".join(text.split())[:300]
    if isinstance(value, dict):
        inner = value.get("error") if isinstance(value.get("error"), dict) else value
        for key in ("message", "detail", "error"):
            if key in inner and inner[key] not in (None, ""):
                return " ".join(str(inner[key]).split())[:300]
    return " ".join(text.split())[:300]
