"""What a model-server call may do, and how its failures are told: the deadline and retries of each call
(`ServerPolicy`), the sampling settings any server can honour (`check_sampling`), and `ModelServerError`, one line
naming the server, what went wrong and the setting to change."""

from __future__ import annotations

import asyncio
import errno
import json
import math
import random
from dataclasses import dataclass
from typing import Any

from ermedrag.tools.model_server.replies import ReplyCut, ReplyShapeError, ReplyStreamError

DEFAULT_REQUEST_TIMEOUT_S = 60.0  # the deadline of one attempt: connect, wait and read
DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_MAX_RETRIES = 2
DEFAULT_RETRY_BACKOFF_S = 0.5  # first wait; doubles per retry, up to MAX_RETRY_BACKOFF_S
MAX_RETRY_BACKOFF_S = 8.0
MAX_RETRIES_ALLOWED = 10
MAX_DETAIL_CHARS = 200


# --------------------------------------------------------------------------------------------- the policy


@dataclass(frozen=True)
class ServerPolicy:
    """How long one attempt at a model-server request may take and how often a failed one is tried again.

    A call takes at most (max_retries + 1) × timeout_s + the backoffs between them."""

    timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    max_retries: int = DEFAULT_MAX_RETRIES
    retry_backoff_s: float = DEFAULT_RETRY_BACKOFF_S

    def __post_init__(self) -> None:
        for name, knob, value in (
            ("request_timeout_s", "--timeout", self.timeout_s),
            ("connect_timeout_s", "--connect-timeout", self.connect_timeout_s),
        ):
            if not _number(value) or value <= 0:
                raise ValueError(f"{name} ({knob}) must be a positive number of seconds, got {value!r}")
        if not isinstance(self.max_retries, int) or not 0 <= self.max_retries <= MAX_RETRIES_ALLOWED:
            raise ValueError(
                f"max_retries (--retries) must be an integer from 0 to {MAX_RETRIES_ALLOWED}, got {self.max_retries!r}"
            )
        if not _number(self.retry_backoff_s) or self.retry_backoff_s < 0:
            raise ValueError(f"retry_backoff_s must be a non-negative number of seconds, got {self.retry_backoff_s!r}")

    def backoff_s(self, retry: int) -> float:
        """The wait before retry number `retry` (0 = the first): doubling from `retry_backoff_s`, capped, and up
        to 25% shorter at random so that concurrent questions hitting one server do not retry in lockstep."""
        cap = max(MAX_RETRY_BACKOFF_S, self.retry_backoff_s)
        return min(cap, self.retry_backoff_s * 2 ** min(retry, 16)) * (1 - 0.25 * random.random())


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# --------------------------------------------------------------------------------------------- the errors


class ModelServerError(RuntimeError):
    """A model-server call that failed, after its retries. Not a ValueError: the user's input was fine.

    `cause` is short and stable: refused | unreachable | connect_timeout | timeout | dropped | http_5xx:503 |
    http_4xx:404 | malformed_json | wrong_shape | stream_error. The message is one line: the URL, what went
    wrong, the setting to change."""

    def __init__(self, message: str, url: str, model: str, cause: str, attempts: int = 1):
        super().__init__(message)
        self.url, self.model, self.cause, self.attempts = url, model, cause, attempts

    @property
    def server_down(self) -> bool:
        """No connection at all (after the retries): every further call to this server would fail the same way."""
        return self.cause in SERVER_DOWN_CAUSES

    def __reduce__(self) -> tuple[Any, ...]:  # picklable (process pools, checkpoints) with its fields
        return type(self), (str(self), self.url, self.model, self.cause, self.attempts)


# Worth another try: the server may be starting, restarting, overloaded or briefly unreachable. A 4xx other than
# these, or a reply that is not a chat completion, would fail the same way again.
RETRYABLE_STATUS = (408, 409, 429)
RETRYABLE_CAUSES = ("refused", "unreachable", "connect_timeout", "timeout", "dropped", "stream_error")
SERVER_DOWN_CAUSES = ("refused", "unreachable", "connect_timeout")


def is_retryable(cause: str) -> bool:
    if cause.startswith("http_"):
        status = int(cause.rpartition(":")[2])
        return status >= 500 or status in RETRYABLE_STATUS
    return cause in RETRYABLE_CAUSES


class HTTPStatus(Exception):
    def __init__(self, status: int, detail: str):
        super().__init__(f"HTTP {status}: {detail}")
        self.status, self.detail = status, detail


def classify_failure(err: BaseException) -> tuple[str, str]:
    """(cause, detail) of what went wrong in one attempt."""
    import httpx

    if isinstance(err, HTTPStatus):
        return f"http_{err.status // 100}xx:{err.status}", _one_line(err.detail)
    if isinstance(err, (asyncio.TimeoutError, TimeoutError)):
        return "timeout", ""
    if isinstance(err, httpx.ConnectTimeout):
        return "connect_timeout", ""
    if isinstance(err, httpx.TimeoutException):
        return "timeout", ""
    if isinstance(err, httpx.ConnectError):
        refused = (
            any(
                isinstance(e, ConnectionRefusedError) or getattr(e, "errno", None) == errno.ECONNREFUSED
                for e in _chain(err)
            )
            or "refused" in str(err).lower()
        )
        return ("refused", "") if refused else ("unreachable", _one_line(str(err)))
    if isinstance(err, json.JSONDecodeError):
        return "malformed_json", _one_line(str(err))
    if isinstance(err, ReplyShapeError):
        return "wrong_shape", _one_line(str(err))
    if isinstance(err, ReplyStreamError):
        return "stream_error", _one_line(str(err))
    if isinstance(err, (ReplyCut, httpx.TransportError, ConnectionError)):
        return "dropped", _one_line(str(err) or type(err).__name__)
    return "wrong_shape", _one_line(f"{type(err).__name__}: {err}")


def _chain(err: BaseException, limit: int = 8) -> list[BaseException]:
    chain: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and len(chain) < limit and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _one_line(text: str) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= MAX_DETAIL_CHARS else flat[: MAX_DETAIL_CHARS - 1] + "…"


def server_error_message(cause: str, detail: str, url: str, model: str, policy: ServerPolicy, attempts: int) -> str:
    """One line: the server, what went wrong, and which setting changes it."""
    who = f"model server {url}"
    tried = model + (f", {attempts} attempts" if attempts > 1 else "")
    detail = f": {detail}" if detail else ""
    endpoint = "is --base-url (OPENAI_BASE_URL) an OpenAI-compatible endpoint ending in /v1?"
    retries = "--retries (ERMEDRAG_MAX_RETRIES)"
    if cause == "refused":
        return f"{who} refused the connection ({tried}); is it running? (--base-url / OPENAI_BASE_URL)"
    if cause == "unreachable":
        return f"{who} is unreachable ({tried}){detail}; check --base-url / OPENAI_BASE_URL"
    if cause == "connect_timeout":
        return (
            f"{who} did not accept the connection within {policy.connect_timeout_s:g} s ({tried}); check "
            f"--base-url, or raise --connect-timeout (ERMEDRAG_CONNECT_TIMEOUT_S)"
        )
    if cause == "timeout":
        return (
            f"{who} did not answer within {policy.timeout_s:g} s ({tried}); a slow server needs a longer "
            f"--timeout (ERMEDRAG_REQUEST_TIMEOUT_S: the deadline of each attempt, from connecting to the last "
            f"byte), a stuck one a restart"
        )
    if cause == "dropped":
        return (
            f"{who} dropped the connection mid-response ({tried}){detail}; see the server's log (crashed? out "
            f"of memory?), or raise {retries}"
        )
    if cause == "stream_error":
        return f"{who} reported an error mid-response ({tried}){detail}; see the server's log, or raise {retries}"
    if cause == "malformed_json":
        return f"{who} answered with malformed JSON ({tried}){detail}; {endpoint}"
    if cause == "wrong_shape":
        return f"{who} answered with something that is not a chat completion ({tried}){detail}; {endpoint}"
    status = int(cause.rpartition(":")[2])
    if status >= 500:
        return f"{who} failed with HTTP {status} ({tried}){detail}; see the server's log, or raise {retries}"
    if status in (401, 403):
        return f"{who} refused the credentials with HTTP {status} ({tried}){detail}; set OPENAI_API_KEY"
    if status == 404:
        return (
            f"{who} answered HTTP 404 ({tried}){detail}; check the model name (--model) and that --base-url ends in /v1"
        )
    if status == 429:
        return f"{who} is rate-limiting (HTTP 429, {tried}){detail}; lower --concurrency or raise {retries}"
    return f"{who} rejected the request with HTTP {status} ({tried}){detail}"


# --------------------------------------------------------------------------------------- sampling checks

MAX_TEMPERATURE = 2.0  # the OpenAI API's range; a higher one is a mistake, not a setting
MAX_NEW_TOKENS_ALLOWED = 1_000_000


def check_sampling(*, temperature: Any, top_p: Any, max_new_tokens: Any) -> None:
    """Refuse sampling settings no backend can honour, naming the field, before anything is sent or loaded."""
    if not _number(temperature) or not 0 <= temperature <= MAX_TEMPERATURE:
        raise ValueError(f"temperature must be a finite number from 0 to {MAX_TEMPERATURE:g}, got {temperature!r}")
    if not _number(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be a finite number above 0 and at most 1, got {top_p!r}")
    if (
        not isinstance(max_new_tokens, int)
        or isinstance(max_new_tokens, bool)
        or not 0 <= max_new_tokens <= MAX_NEW_TOKENS_ALLOWED
    ):
        raise ValueError(
            f"max_new_tokens must be an integer from 0 to {MAX_NEW_TOKENS_ALLOWED:,}, got {max_new_tokens!r}"
        )
