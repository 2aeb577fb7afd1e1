"""Retrieval over a corpus index: documents read and chunked (`corpus`), embedded (`encoder`) into Chroma beside BM25
in segments (`bm25`, `index`, `index_files`), searched coarse to fine (`search`).

    from ermedrag.tools.retrieval import open_index, retrieve
    snippets = retrieve(open_index("indexes/mine"), "Which drug is first-line for type 2 diabetes?", k=10)
"""

from ermedrag.tools.retrieval.index import Index, build_index, open_index
from ermedrag.tools.retrieval.search import RetrievalConfig, Snippet, retrieve, retrieve_many

__all__ = ["Index", "RetrievalConfig", "Snippet", "build_index", "open_index", "retrieve", "retrieve_many"]
