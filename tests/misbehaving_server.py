"""A real OpenAI-compatible HTTP server on 127.0.0.1 that fails on purpose, one way per mode.

For tests and the reliability bench: each mode is one way a model server goes wrong in production.

    with MisbehavingServer("hang") as server:          # in-process, one thread per request
        load_chat_model("openai:x", base_url=server.base_url, timeout_s=1).invoke("hi")
        server.requests                                # chat requests received so far

    with refused_url() as base_url: ...                # a port that refuses connections

    python -m tests.misbehaving_server --mode 5xx --port 8999     # the same server as a process

Modes (`MODES`):
    ok             a valid chat completion, in the format of the agent that asked (the scripted replies);
                   server-sent events when the request streams
    hang           accepts the request and never answers (until the server stops)
    5xx            503 with an OpenAI-style JSON error body (`status` changes the code)
    malformed_json 200, `Content-Type: application/json`, a body that is not JSON
    wrong_shape    200, valid JSON without `choices`
    dropped        200 headers announcing a body, half of it, then the socket closes
    slow_then_ok   waits `delay_s`, then answers like `ok`
    fail_then_ok   the first `failures` requests get a 503, the rest answers like `ok` (retries)
A port nobody listens on (`refused_url`) is the eighth: connection refused.
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

MODES = ("ok", "hang", "5xx", "malformed_json", "wrong_shape", "dropped", "slow_then_ok", "fail_then_ok")
MAX_BODY_BYTES = 4 * 1024 * 1024  # a test server still bounds what it reads


def scripted_content(body: dict[str, Any]) -> str:
    """What the scripted model would reply to the request's messages (so a whole graph runs against `ok`)."""
    from langchain_core.messages import convert_to_messages

    from ermedrag.agents.scripted import reply

    return reply(convert_to_messages(body.get("messages") or [{"role": "user", "content": ""}]))


def completion(body: dict[str, Any]) -> dict[str, Any]:
    content = scripted_content(body)
    prompt_words = sum(len(str(m.get("content", "")).split()) for m in body.get("messages") or [])
    return {
        "id": "cmpl-misbehaving", "object": "chat.completion", "created": int(time.time()),
        "model": body.get("model", "x"),
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}],
        "usage": {"prompt_tokens": prompt_words, "completion_tokens": len(content.split()),
                  "total_tokens": prompt_words + len(content.split())},
    }


def stream_events(body: dict[str, Any]) -> bytes:
    """The same completion as server-sent events (a request with `"stream": true`): the content, the finish
    reason, the usage when `stream_options.include_usage` asks for it, then `[DONE]`."""
    whole = completion(body)
    base = {key: whole[key] for key in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    content = whole["choices"][0]["message"]["content"]
    chunks = [
        base | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": content}, "finish_reason": None}]},
        base | {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ]
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append(base | {"choices": [], "usage": whole["usage"]})
    return b"".join(f"data: {json.dumps(chunk)}\n\n".encode() for chunk in chunks) + b"data: [DONE]\n\n"


class MisbehavingServer:
    """An HTTP server in a background thread; `base_url` ends in /v1 like any OpenAI-compatible server."""

    def __init__(self, mode: str, *, port: int = 0, delay_s: float = 1.0, failures: int = 2, status: int = 503):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
        self.mode, self.delay_s, self.failures, self.status = mode, delay_s, failures, status
        self.requests = 0  # chat-completion requests received (retries included)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), _handler_for(self))
        self._httpd.daemon_threads = True
        # A short poll keeps `stop` quick (serve_forever checks for shutdown every poll_interval).
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"misbehaving-{mode}", daemon=True)

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
        self._stopping.set()  # releases `hang` handlers
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MisbehavingServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _count(self) -> int:
        with self._lock:
            self.requests += 1
            return self.requests


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
            n = server._count()
            try:
                body = json.loads(raw or b"{}")
            except ValueError:
                body = {}
            mode = server.mode
            if mode == "hang":
                server._stopping.wait()
                self.close_connection = True
                return
            if mode == "5xx" or (mode == "fail_then_ok" and n <= server.failures):
                self._send_json(server.status, {"error": {"message": "server overloaded (misbehaving test server)",
                                                          "type": "server_error", "code": server.status}})
            elif mode == "malformed_json":
                self._send_bytes(200, b'{"id": "cmpl-broken", "choices": [{"message": ', "application/json")
            elif mode == "wrong_shape":
                self._send_json(200, {"id": "cmpl-odd", "object": "chat.completion", "result": "no choices here"})
            elif mode == "dropped":
                payload = json.dumps(completion(body)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload[: len(payload) // 2])
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
            else:  # ok, slow_then_ok, fail_then_ok after its failures
                if mode == "slow_then_ok":
                    server._stopping.wait(server.delay_s)
                if body.get("stream"):
                    self._send_bytes(200, stream_events(body), "text/event-stream")
                else:
                    self._send_json(200, completion(body))

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
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay", type=float, default=1.0, help="slow_then_ok: seconds before answering")
    parser.add_argument("--failures", type=int, default=2, help="fail_then_ok: requests that fail first")
    parser.add_argument("--status", type=int, default=503, help="5xx/fail_then_ok: the error status")
    args = parser.parse_args()
    server = MisbehavingServer(args.mode, port=args.port, delay_s=args.delay, failures=args.failures,
                               status=args.status).start()
    print(f"{args.mode} server on {server.base_url}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
