"""ermedrag: reliable medical question answering with retrieval on LangGraph, and the RL loop that trains its
agents from the app's own recorded runs.

    from ermedrag.graphs.er_medrag import graph          # or: ermedrag.load_graph("er_medrag")
    state = graph.invoke({"question": "...", "options": {"A": "...", "B": "..."}})

The subpackages, bottom to top (an import only points down): `ermedrag.agents` (prompts, output types,
parsers) → `ermedrag.tools` (chat models, corpus, index, retrieval, traces, benchmark data) →
`ermedrag.graphs` (the LangGraph graphs and their registry) → `ermedrag.training` | `ermedrag.evals` →
this package (the public API and the `ermedrag` command line).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.2.0"
__all__ = ["__version__", "graph_names", "load_graph"]


def graph_names() -> list[str]:
    """The registered graphs (`ermedrag.graphs.registry.GRAPHS`)."""
    from ermedrag.graphs.registry import GRAPHS

    return list(GRAPHS)


def load_graph(name: str) -> Any:
    """The compiled graph registered under `name` (imported on first use: importing `ermedrag` stays cheap)."""
    from ermedrag.graphs.registry import load_graph as load

    return load(name)
