"""The graphs' context schema: their configuration, which LangGraph Studio edits. Every field falls back to its
environment variable (`tools.settings`, which also gives Studio each field's description); a context checks its
numbers when it is built."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ermedrag.tools.model_server import MAX_TEMPERATURE, ServerPolicy
from ermedrag.tools.settings import context_field


@dataclass(kw_only=True)
class Context:
    """Run configuration of ER-MedRAG and the baselines (Med-R³'s and MMedAgent's contexts extend it)."""

    extractor_model: str = context_field("ERMEDRAG_EXTRACTOR_MODEL")
    respondent_model: str = context_field("ERMEDRAG_RESPONDENT_MODEL")
    base_url: str = context_field("OPENAI_BASE_URL")
    index_dir: str = context_field("ERMEDRAG_INDEX_DIR")
    chroma_url: str = context_field("ERMEDRAG_CHROMA_URL")
    coarse_k: int = context_field("ERMEDRAG_COARSE_K")
    reranker: str = context_field("ERMEDRAG_RERANKER")
    snippets_k: int = context_field("ERMEDRAG_SNIPPETS_K")
    temperature: float = context_field("ERMEDRAG_TEMPERATURE")
    extractor_max_new_tokens: int = context_field("ERMEDRAG_EXTRACTOR_MAX_NEW_TOKENS")
    respondent_max_new_tokens: int = context_field("ERMEDRAG_RESPONDENT_MAX_NEW_TOKENS")
    answer_extraction: bool = context_field("ERMEDRAG_ANSWER_EXTRACTION")
    # Adds a confidence to an answer, never changes it: not part of any graph's settings (graphs.registry).
    answer_scores: bool = context_field("ERMEDRAG_ANSWER_SCORES")
    trace_db: str = context_field("ERMEDRAG_TRACE_DB")
    # How long a model server (openai: models) may take. They change when an answer arrives, never which one:
    # not part of any graph's settings (graphs.registry), so results do not split on them.
    request_timeout_s: float = context_field("ERMEDRAG_REQUEST_TIMEOUT_S")
    connect_timeout_s: float = context_field("ERMEDRAG_CONNECT_TIMEOUT_S")
    max_retries: int = context_field("ERMEDRAG_MAX_RETRIES")
    retry_backoff_s: float = context_field("ERMEDRAG_RETRY_BACKOFF_S")

    def __post_init__(self) -> None:
        # Counts, budgets, temperatures and timeouts are finite and never negative: a negative k would reach a
        # Python slice and silently mean "all but the last few", a NaN temperature a server as a request it
        # refuses. Subclasses (Med-R³'s budgets) are checked the same way.
        for name, value in vars(self).items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"context field {name!r} must be a finite number, got {value}")
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                raise ValueError(f"context field {name!r} must be >= 0, got {value}")
            if name == "temperature" and value > MAX_TEMPERATURE:
                raise ValueError(f"context field 'temperature' must be at most {MAX_TEMPERATURE:g}, got {value}")


def sampling(ctx: Context, model: str, max_new_tokens: int) -> dict[str, Any]:
    return {"model": model, "temperature": ctx.temperature, "max_new_tokens": max_new_tokens}


def server_policy(ctx: Context) -> ServerPolicy:
    """The context's timeouts and retries (a ValueError naming the field when one is out of range)."""
    return ServerPolicy(ctx.request_timeout_s, ctx.connect_timeout_s, ctx.max_retries, ctx.retry_backoff_s)
