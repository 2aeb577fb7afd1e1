"""The systems compared, each a function query -> ranked results over one opened index.

A result is a `Span` (document id and character range): a chunk for the chunk retrievers, a sentence
window for ours. Every system sees the same chunks and the same encoder; the baselines run as a user of
that tool would run it (bm25s and RRF with their defaults, llama-index's hybrid with its defaults).
"""

from __future__ import annotations

from typing import Any, Callable

from data import Span
from scoring import DEPTH

System = Callable[[str], list[Span]]
MEDRAG_RRF_K = 100  # MedRAG's RRF constant; each retriever fetches max(2k, 100)


def clean(query: str) -> str:
    from ermedrag.tools.retrieval.search import clean_query

    return clean_query(query)


def chunk_span(chunk_id: str) -> Span:
    """Chunk ids are `doc#start-end` with offsets into the document."""
    doc_id, _, offsets = chunk_id.rpartition("#")
    start, _, end = offsets.partition("-")
    return Span(doc_id, int(start), int(end))


def default_bm25(index: Any) -> Any:
    """bm25s with its own default parameters over the index's chunks (the `bm25` baseline's index)."""
    import bm25s

    from ermedrag.tools.retrieval.bm25 import SingleBM25s, bm25_tokenize
    from ermedrag.tools.retrieval.index_files import chunk_texts

    ids, texts = chunk_texts(index.collection)
    retriever = bm25s.BM25()
    retriever.index(bm25_tokenize(texts), show_progress=False)
    return SingleBM25s(retriever), ids


def make_systems(index: Any) -> dict[str, System]:
    from dataclasses import replace

    from ermedrag.tools.retrieval.index import Index
    from ermedrag.tools.retrieval.search import (
        DEFAULT_CONFIG,
        ChunkHit,
        RetrievalConfig,
        bm25_search,
        coarse_hybrid,
        dense_search,
        retrieve,
        rrf_fuse,
    )

    bm25, bm25_ids = default_bm25(index)
    baseline_index = Index(index.directory, index.encoder, index.collection, bm25, bm25_ids)

    def bm25_hits(query: str, k: int) -> list[ChunkHit]:
        return bm25_search(baseline_index, query, k)

    def medrag_rrf(query: str) -> list[Span]:
        fetch = max(2 * DEPTH, 100)
        fused = rrf_fuse(
            {"bm25": bm25_hits(query, fetch), "dense": dense_search(index, query, fetch)}, DEPTH, MEDRAG_RRF_K
        )
        return [chunk_span(h.chunk_id) for h in fused]

    def chunks_of(config: RetrievalConfig) -> System:
        return lambda q: [chunk_span(h.chunk_id) for h in coarse_hybrid(index, clean(q), DEPTH, config)]

    return {
        "bm25": lambda q: [chunk_span(h.chunk_id) for h in bm25_hits(clean(q), DEPTH)],
        "dense": lambda q: [chunk_span(h.chunk_id) for h in dense_search(index, clean(q), DEPTH)],
        "medrag_rrf": lambda q: medrag_rrf(clean(q)),
        "llamaindex_fusion": llamaindex_fusion(index, bm25_ids),
        # The project's default pipeline (tools.retrieval.retrieve with its defaults), asked for DEPTH snippets
        # (for MRR@100), and as a user calls it for ten (recall@10 of the call the README quotes).
        "ours": lambda q: [Span(s.doc_id, s.start, s.end) for s in retrieve(index, q, k=DEPTH)],
        "ours_k10": lambda q: [Span(s.doc_id, s.start, s.end) for s in retrieve(index, q, k=10)],
        # Ablations of ours: its coarse stage alone (whole chunks), and without pseudo-relevance feedback.
        "ours_coarse_only": chunks_of(DEFAULT_CONFIG),
        "ours_no_feedback": chunks_of(replace(DEFAULT_CONFIG, feedback_chunks=0)),
    }


def llamaindex_fusion(index: Any, chunk_ids: list[str]) -> System:
    """llama-index's hybrid: QueryFusionRetriever over its BM25Retriever and a vector retriever on the same
    Chroma collection, reciprocal-rank fusion, no LLM query generation (num_queries=1)."""
    from llama_index.core import VectorStoreIndex
    from llama_index.core.base.embeddings.base import BaseEmbedding
    from llama_index.core.llms import MockLLM
    from llama_index.core.retrievers import QueryFusionRetriever
    from llama_index.core.schema import TextNode
    from llama_index.retrievers.bm25 import BM25Retriever
    from llama_index.vector_stores.chroma import ChromaVectorStore

    from ermedrag.tools.retrieval.bm25 import snowball_stemmer
    from ermedrag.tools.retrieval.encoder import encode

    class LocalEmbedding(BaseEmbedding):
        """The bench's encoder for llama-index (its HuggingFace embedding package is not installed)."""

        def _get_query_embedding(self, query: str) -> list[float]:
            return encode([query], index.encoder)[0].tolist()

        def _get_text_embedding(self, text: str) -> list[float]:
            return self._get_query_embedding(text)

        async def _aget_query_embedding(self, query: str) -> list[float]:
            return self._get_query_embedding(query)

    from ermedrag.tools.retrieval.index_files import chunk_texts

    ids, texts = chunk_texts(index.collection)
    nodes = [TextNode(id_=cid, text=text) for cid, text in zip(ids, texts)]
    fetch = max(2 * DEPTH, 100)
    bm25 = BM25Retriever.from_defaults(
        nodes=nodes, similarity_top_k=fetch, stemmer=snowball_stemmer(), language="english"
    )
    vectors = VectorStoreIndex.from_vector_store(
        ChromaVectorStore(chroma_collection=index.collection), embed_model=LocalEmbedding()
    )
    fusion = QueryFusionRetriever(
        [vectors.as_retriever(similarity_top_k=fetch), bm25],
        llm=MockLLM(),
        mode="reciprocal_rerank",
        similarity_top_k=DEPTH,
        num_queries=1,
        use_async=False,
    )
    return lambda q: [chunk_span(n.node.node_id) for n in fusion.retrieve(clean(q))]
