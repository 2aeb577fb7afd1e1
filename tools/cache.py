"""`shared_resource`: build a heavy object (model, index, store) once per arguments, safely across threads.

Graph branches run in threads; a plain lru_cache lets two of them load the same model at once.
"""

from __future__ import annotations

import threading
from functools import lru_cache, wraps
from typing import Callable, TypeVar

T = TypeVar("T")


def shared_resource(maxsize: int = 8) -> Callable[[Callable[..., T]], Callable[..., T]]:
    def decorate(build: Callable[..., T]) -> Callable[..., T]:
        cached = lru_cache(maxsize=maxsize)(build)
        lock = threading.RLock()

        @wraps(build)
        def get(*args, **kwargs) -> T:
            with lock:
                return cached(*args, **kwargs)

        get.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
        return get

    return decorate
