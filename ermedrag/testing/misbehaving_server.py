"""An OpenAI-compatible HTTP server on 127.0.0.1 that fails on purpose, one way per mode, for tests and benches.

The graphs' real-server tests run against real server implementations (`ermedrag.testing.real_servers`); this one
is for what a real server cannot be made to do on demand: hang, trickle, crash mid-reply, answer nonsense.

    with MisbehavingServer("hang") as server:          # in-process, one thread per request
        load_chat_model("openai:x", base_url=server.base_url, timeout_s=1).invoke("hi")
        server.requests, server.bodies                 # chat requests received so far, and their JSON bodies

    with refused_url() as base_url: ...                # a port that refuses connections

    python -m ermedrag.testing.misbehaving_server --mode 5xx --port 8999     # the same server as a process

A mode that answers (`ok`, `slow_then_ok`, `fail_then_ok`) replies what the scripted model would, then keeps
writing (`TRAILING`), as a model does past its closing tag; the `flavour` says how it treats the request's `stop`:
    openai      cuts the text before the first stop string and says only `finish_reason: "stop"` (the OpenAI API,
                llama.cpp's server)
    vllm        the same, and names the string in `stop_reason` on every choice; `include_stop_str_in_output`
                keeps it in the text (vLLM)
    keeps_stop  stops after the stop string, keeping it (`transformers serve`)
Each honours `max_tokens` / `max_completion_tokens` (a word is a token) and streams a word per chunk. `strict=True`
makes it refuse what the OpenAI API refuses, with its words (HTTP 400): a field it does not know, and both
token-limit fields in one request.

Modes (`MODES`):
    ok             a valid chat completion (streamed when the request streams)
    hang           accepts the request and never answers (until the server stops)
    5xx            `status` (503) with an OpenAI-style JSON error body
    malformed_json 200, `Content-Type: application/json`, a body that is not JSON
    wrong_shape    200, valid JSON without `choices`
    empty_choices  200, `"choices": []`
    no_message     200, a choice without `message`
    null_content   200, `"content": null`
    wrong_types    200, `"content": 42`
    dropped        200 headers announcing a body, half of it, then the socket closes
    stream_error   200, a streamed chunk, then `data: {"error": ...}` (how vLLM reports an engine failure mid-stream)
    trickle        200 headers, then one byte every `delay_s` of a reply that never ends
    ignores_limit  streams word after word, past any token limit, until the client hangs up
    slow_then_ok   waits `delay_s`, then answers like `ok`
    fail_then_ok   the first `failures` requests get a 503, the rest answers like `ok` (retries)
A port nobody listens on (`refused_url`) is one more: connection refused.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

MODES = (
    "ok",
    "hang",
    "5xx",
    "malformed_json",
    "wrong_shape",
    "empty_choices",
    "no_message",
    "null_content",
    "wrong_types",
    "dropped",
    "stream_error",
    "trickle",
    "ignores_limit",
    "slow_then_ok",
    "fail_then_ok",
)
FLAVOURS = ("openai", "vllm", "keeps_stop")
TRAILING = "\nThe model keeps writing after its answer, as models do."
# The OpenAI API's chat-completion request fields (what `strict` accepts).
OPENAI_FIELDS = frozenset(
    {
        "messages",
        "model",
        "audio",
        "frequency_penalty",
        "function_call",
        "functions",
        "logit_bias",
        "logprobs",
        "max_completion_tokens",
        "max_tokens",
        "metadata",
        "modalities",
        "n",
        "parallel_tool_calls",
        "prediction",
        "presence_penalty",
        "reasoning_effort",
        "response_format",
        "seed",
        "service_tier",
        "stop",
        "store",
        "stream",
        "stream_options",
        "temperature",
        "tool_choice",
        "tools",
        "top_logprobs",
        "top_p",
        "user",
        "web_search_options",
    }
)
MAX_BODY_BYTES = 4 * 1024 * 1024  # a test server still bounds what it reads


def scripted_content(body: dict[str, Any]) -> str:
    """What the scripted model would reply to the request's messages (so a whole graph runs against `ok`)."""
    from langchain_core.messages import convert_to_messages

    from ermedrag.testing.scripted import reply

    messages = body.get("messages") or [{"role": "user", "content": ""}]
    return reply(convert_to_messages([{**m, "content": _text(m.get("content"))} for m in messages]))


def _text(content: Any) -> str:
    if isinstance(content, list):
        return " ".join(block.get("text", "") for block in content if isinstance(block, dict))
    return str(content or "")


def generate(body: dict[str, Any], flavour: str) -> tuple[list[str], str, str | None]:
    """The reply's words (a word is a token), its finish reason and vLLM's stop reason, as a server of `flavour`
    applies the request's `stop` and token limit to the scripted reply followed by TRAILING."""
    text = scripted_content(body) + TRAILING
    stops = body.get("stop") or []
    stops = [stops] if isinstance(stops, str) else [s for s in stops if isinstance(s, str) and s]
    hits = sorted((text.find(s), s) for s in stops if s in text)
    stop_reason = None
    if hits:
        index, stop_reason = hits[0]
        keep = flavour == "keeps_stop" or (flavour == "vllm" and body.get("include_stop_str_in_output"))
        text = text[: index + (len(stop_reason) if keep else 0)]
    words = [w for w in text.replace("\n", "\n ").split(" ") if w]
    words = [w if i == 0 else " " + w for i, w in enumerate(words)]
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    if isinstance(limit, int) and len(words) > limit:
        return words[:limit], "length", None
    return words, "stop", stop_reason


def _choice(flavour: str, stop_reason: str | None, **fields: Any) -> dict[str, Any]:
    return {"index": 0, **fields, **({"stop_reason": stop_reason} if flavour == "vllm" else {})}


def completion(body: dict[str, Any], flavour: str = "openai") -> dict[str, Any]:
    words, finish, stop_reason = generate(body, flavour)
    prompt_words = sum(len(_text(m.get("content")).split()) for m in body.get("messages") or [])
    message = {"role": "assistant", "content": "".join(words)}
    return {
        "id": "cmpl-misbehaving",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model", "x"),
        "choices": [_choice(flavour, stop_reason, finish_reason=finish, message=message)],
        "usage": {
            "prompt_tokens": prompt_words,
            "completion_tokens": len(words),
            "total_tokens": prompt_words + len(words),
        },
    }


def _event(payload: dict[str, Any] | str) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


def stream_events(body: dict[str, Any], flavour: str = "openai") -> Iterator[bytes]:
    """The same completion as server-sent events: a role chunk, a word per chunk, the finish reason, the usage when
    `stream_options.include_usage` asks for it (`keeps_stop`: always, as `transformers serve` does), `[DONE]`."""
    words, finish, stop_reason = generate(body, flavour)
    base = {
        "id": "cmpl-misbehaving",
        "created": int(time.time()),
        "model": body.get("model", "x"),
        "object": "chat.completion.chunk",
    }
    yield _event(
        base | {"choices": [_choice(flavour, None, delta={"role": "assistant", "content": ""}, finish_reason=None)]}
    )
    for word in words:
        yield _event(base | {"choices": [_choice(flavour, None, delta={"content": word}, finish_reason=None)]})
    yield _event(base | {"choices": [_choice(flavour, stop_reason, delta={}, finish_reason=finish)]})
    if (body.get("stream_options") or {}).get("include_usage") or flavour == "keeps_stop":
        usage = completion(body, flavour)["usage"]
        yield _event(base | {"choices": [], "usage": usage})
    yield _event("[DONE]")


class MisbehavingServer:
    """An HTTP server in a background thread; `base_url` ends in /v1 like any OpenAI-compatible server."""

    def __init__(
        self,
        mode: str,
        *,
        port: int = 0,
        delay_s: float = 1.0,
        failures: int = 2,
        status: int = 503,
        flavour: str = "openai",
        strict: bool = False,
    ):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
        if flavour not in FLAVOURS:
            raise ValueError(f"unknown flavour {flavour!r}; expected one of {FLAVOURS}")
        self.mode, self.delay_s, self.failures, self.status, self.flavour = mode, delay_s, failures, status, flavour
        self.strict = strict
        self.requests = 0  # chat-completion requests received (retries included)
        self.bodies: list[dict[str, Any]] = []  # their JSON bodies, in order
        self.disconnects = 0  # streams the client closed before the server finished them
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._httpd = _QuietServer(("127.0.0.1", port), _handler_for(self))
        self._httpd.daemon_threads = True
        # A short poll keeps `stop` quick (serve_forever checks for shutdown every poll_interval).
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name=f"misbehaving-{mode}", daemon=True
        )

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> MisbehavingServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()  # releases `hang` and `trickle` handlers
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MisbehavingServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _count(self, body: dict[str, Any]) -> int:
        with self._lock:
            self.requests += 1
            self.bodies.append(body)
            return self.requests


class _QuietServer(ThreadingHTTPServer):
    """A client hanging up (as the openai: backend does at a stop string) is normal here, not an error to print."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(request, client_address)


BROKEN_COMPLETIONS = {
    "wrong_shape": {"id": "cmpl-odd", "object": "chat.completion", "result": "no choices here"},
    "empty_choices": {"id": "cmpl-odd", "object": "chat.completion", "choices": []},
    "no_message": {"id": "cmpl-odd", "object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop"}]},
    "null_content": {
        "id": "cmpl-odd",
        "object": "chat.completion",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": None}}],
    },
    "wrong_types": {
        "id": "cmpl-odd",
        "object": "chat.completion",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": 42}}],
    },
}


def strict_refusal(body: Any) -> str | None:
    """What the OpenAI API says to a request it refuses (its words), or None."""
    if not isinstance(body, dict):
        return "We could not parse the JSON body of your request."
    unknown = sorted(set(body) - OPENAI_FIELDS)
    if unknown:
        return f"Unrecognized request argument supplied: {unknown[0]}"
    if "max_tokens" in body and "max_completion_tokens" in body:
        return "Setting 'max_tokens' and 'max_completion_tokens' at the same time is not supported."
    return None


def _handler_for(server: MisbehavingServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive and Content-Length, like real servers

        def log_message(self, format: str, *args: Any) -> None:  # quiet: tests read their own output
            pass

        def do_GET(self) -> None:
            self._send_json(200, {"object": "list", "data": [{"id": "misbehaving", "object": "model"}]})

        def do_POST(self) -> None:
            length = min(int(self.headers.get("Content-Length") or 0), MAX_BODY_BYTES)
            raw = self.rfile.read(length)
            try:
                body = json.loads(raw or b"{}")
            except ValueError:
                body = {}
            n = server._count(body if isinstance(body, dict) else {})
            mode = server.mode
            refusal = strict_refusal(body) if server.strict else None
            if refusal:
                self._send_json(400, {"error": {"message": refusal, "type": "invalid_request_error"}})
            elif mode == "hang":
                server._stopping.wait()
                self.close_connection = True
            elif mode == "5xx" or (mode == "fail_then_ok" and n <= server.failures):
                self._send_json(
                    server.status,
                    {
                        "error": {
                            "message": "server overloaded (misbehaving test server)",
                            "type": "server_error",
                            "code": server.status,
                        }
                    },
                )
            elif mode == "malformed_json":
                self._send_bytes(200, b'{"id": "cmpl-broken", "choices": [{"message": ', "application/json")
            elif mode in BROKEN_COMPLETIONS:
                self._send_json(200, BROKEN_COMPLETIONS[mode])
            elif mode == "dropped":
                payload = json.dumps(completion(body, server.flavour)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload[: len(payload) // 2])
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
            elif mode == "stream_error":
                events = stream_events(body, server.flavour)
                self._stream(
                    [
                        next(events),
                        next(events),
                        _event({"error": {"message": "engine crashed (test)", "type": "internal_error"}}),
                        _event("[DONE]"),
                    ]
                )
            elif mode == "trickle":
                self._trickle()
            elif mode == "ignores_limit":
                self._stream(self._endless(body))
            else:  # ok, slow_then_ok, fail_then_ok after its failures
                if mode == "slow_then_ok":
                    server._stopping.wait(server.delay_s)
                if body.get("stream"):
                    self._stream(stream_events(body, server.flavour))
                else:
                    self._send_json(200, completion(body, server.flavour))

        def _endless(self, body: dict[str, Any]) -> Iterator[bytes]:
            base = {"id": "cmpl-endless", "object": "chat.completion.chunk", "model": body.get("model", "x")}
            while not server._stopping.is_set():
                yield _event(base | {"choices": [{"index": 0, "delta": {"content": " more"}, "finish_reason": None}]})

        def _stream(self, events: Iterator[bytes] | list[bytes]) -> None:
            """Server-sent events, chunked, until done or the client hangs up (counted as a disconnect)."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                for event in events:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                with server._lock:
                    server.disconnects += 1
                self.close_connection = True

        def _trickle(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            payload = b'data: {"choices": [{"index": 0, "delta": {"content": "' + b"a" * 100_000
            try:
                for byte in payload:
                    if server._stopping.wait(server.delay_s):
                        break
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                with server._lock:
                    server.disconnects += 1
            self.close_connection = True

        def _send_json(self, status: int, payload: dict[str, Any]) -> None:
            self._send_bytes(status, json.dumps(payload).encode(), "application/json")

        def _send_bytes(self, status: int, payload: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    return Handler


@contextlib.contextmanager
def refused_url() -> Iterator[str]:
    """The base URL of a port that refuses connections: bound (so nobody else takes it) but not listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--flavour", choices=FLAVOURS, default="openai", help="how `stop` is treated (see above)")
    parser.add_argument("--strict", action="store_true", help="refuse what the OpenAI API refuses (HTTP 400)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay", type=float, default=1.0, help="slow_then_ok, trickle: seconds")
    parser.add_argument("--failures", type=int, default=2, help="fail_then_ok: requests that fail first")
    parser.add_argument("--status", type=int, default=503, help="5xx/fail_then_ok: the error status")
    args = parser.parse_args()
    server = MisbehavingServer(
        args.mode,
        port=args.port,
        delay_s=args.delay,
        failures=args.failures,
        status=args.status,
        flavour=args.flavour,
        strict=args.strict,
    ).start()
    print(f"{args.mode} server ({args.flavour}) on {server.base_url}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
