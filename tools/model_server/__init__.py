"""Talking to OpenAI-compatible model servers: the `openai:` backend (`client`), how it reads replies (`replies`),
what a call may do and how it fails (`policy`), and how a server that is not vLLM's continues an assistant turn
(`continuation`)."""

from ermedrag.tools.model_server.client import ServerChatModel, background, server_traits
from ermedrag.tools.model_server.policy import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_MAX_RETRIES,
    DEFAULT_REQUEST_TIMEOUT_S,
    DEFAULT_RETRY_BACKOFF_S,
    MAX_RETRY_BACKOFF_S,
    MAX_TEMPERATURE,
    ModelServerError,
    ServerPolicy,
    check_sampling,
    is_retryable,
)

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_REQUEST_TIMEOUT_S",
    "DEFAULT_RETRY_BACKOFF_S",
    "MAX_RETRY_BACKOFF_S",
    "MAX_TEMPERATURE",
    "ModelServerError",
    "ServerChatModel",
    "ServerPolicy",
    "background",
    "check_sampling",
    "is_retryable",
    "server_traits",
]
