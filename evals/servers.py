"""Spreading an eval's questions over several OpenAI-compatible servers (replicas of one model).

`ermedrag eval --base-url URL1 --base-url URL2` gives each question to the live server with the fewest questions in
flight, so a slower replica gets fewer. A server found down (no connection after the client's retries) leaves the
rotation; the question that found it continues from its checkpoint on the next live server, so nothing it finished
is asked again. Only when every server is down does the eval stop, as it does with one server.

Which server answered is not part of a result's key: replicas serve the same model, so their answers belong to one
configuration.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ermedrag.tools.model_server import ModelServerError


def server_list(base_url: str | Sequence[str] | None) -> list[str | None]:
    """The servers a run was given: None (the context's default: OPENAI_BASE_URL or an in-process model), one URL,
    or several (duplicates dropped, order kept)."""
    if base_url is None or isinstance(base_url, str):
        return [base_url or None]
    urls = list(dict.fromkeys(u.strip() for u in base_url if u and u.strip()))
    return urls or [None]


class ServerPool:
    """Which server the next question goes to. Used from one event loop: no locking needed."""

    def __init__(self, base_url: str | Sequence[str] | None) -> None:
        self.in_flight: dict[str | None, int] = {url: 0 for url in server_list(base_url)}
        self.down: dict[str | None, ModelServerError] = {}
        self.served: dict[str | None, int] = {url: 0 for url in self.in_flight}  # questions finished, per server

    @property
    def live(self) -> list[str | None]:
        return [url for url in self.in_flight if url not in self.down]

    def acquire(self) -> str | None:
        """The live server with the fewest questions in flight (ties: the first given). Raises the last server's
        error when none is live."""
        live = self.live
        if not live:
            raise next(reversed(self.down.values()))
        url = min(live, key=lambda u: self.in_flight[u])
        self.in_flight[url] += 1
        return url

    def release(self, url: str | None, *, answered: bool) -> None:
        self.in_flight[url] -= 1
        self.served[url] += answered

    def mark_down(self, url: str | None, err: ModelServerError) -> bool:
        """Take a server out of the rotation; True when another one is still live (the question moves on)."""
        if url not in self.down:
            self.down[url] = err
            if len(self.in_flight) > 1:
                others = len(self.live)
                rest = {0: "no server is left", 1: "1 other server takes its questions"}.get(
                    others, f"{others} other servers take its questions"
                )
                print(f"server {url} is down ({err.cause}); {rest}", file=sys.stderr, flush=True)
        return bool(self.live)

    def summary(self) -> dict[str, int] | None:
        """Questions answered per server, when there were several (None otherwise)."""
        if len(self.served) < 2:
            return None
        return {str(url): count for url, count in self.served.items()}
