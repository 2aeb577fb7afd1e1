"""The citation parser and resolver (`agents.citations`): the forms a reasoning cites evidence in, what is not a
citation, resolution with provenance, citations of evidence that was not shown, and bounded cost."""

from __future__ import annotations

import time

import pytest

from ermedrag.agents.citations import (
    MAX_CITATIONS,
    citation_keys,
    cite,
    cited_numbers,
    opinion_items,
    render_citations,
    snippet_items,
    triplet_items,
)

SNIPPETS = [
    {
        "id": "pubmed-1-0@0-120",
        "doc_id": "pubmed-1-0",
        "title": "Metformin",
        "source": "pubmed",
        "start": 0,
        "end": 120,
        "text": "Metformin is first-line for type 2 diabetes.",
    },
    {
        "id": "kb-002@5-40",
        "doc_id": "kb-002",
        "title": "Insulin",
        "source": "starter_kb",
        "start": 5,
        "end": 40,
        "text": "Insulin is used when oral drugs fail.",
    },
]


@pytest.mark.parametrize(
    "reasoning, numbers",
    [
        ("Evidence [2] says so.", [2]),
        ("[1, 3] and [3; 4] agree", [1, 3, 4]),
        ("evidence 2 and triplet #3 and fact no. 1", [2, 3, 1]),
        ("Documents 4 and 5 say", [4, 5]),
        ("Specialists 1 and 3 name rickets", [1, 3]),
        ("Point 1: the patient. Step 2: a drug. Age 45.", []),
        ("[0] and [1000] and [12a]", []),
        ("", []),
    ],
)
def test_reads_the_forms_a_reasoning_cites_in(reasoning, numbers):
    assert cited_numbers(reasoning) == numbers


def test_a_bracket_without_a_number_or_snippet_id_is_not_a_citation():
    assert cite("the drug [sic] [note] works", snippet_items(SNIPPETS)) == []


def test_resolves_numbers_and_snippet_ids_with_provenance_and_flags_what_was_not_shown():
    citations = cite(
        "Evidence [2], [pubmed-1-0@0-120], [9] and [other-doc@3-9] agree; [2] again", snippet_items(SNIPPETS)
    )
    assert [(c["number"], c["shown"], c["snippet_id"]) for c in citations] == [
        (2, True, "kb-002@5-40"),
        (1, True, "pubmed-1-0@0-120"),
        (9, False, None),
        (0, False, "other-doc@3-9"),
    ]
    first = citations[1]
    assert (first["doc_id"], first["title"], first["source"], first["start"], first["end"]) == (
        "pubmed-1-0",
        "Metformin",
        "pubmed",
        0,
        120,
    )
    assert citations[2]["text"] == "" and citations[2]["doc_id"] is None
    lines = render_citations(citations)
    assert any("[9] NOT SHOWN" in line for line in lines)
    assert any("doc kb-002 chars 5-40" in line for line in lines)


def test_triplets_carry_their_snippets_provenance():
    triplets = [
        {
            "condition": "type 2 diabetes",
            "relation": "treated with",
            "conclusion": "metformin",
            "snippet_id": "pubmed-1-0@0-120",
        },
        {"condition": "oral failure", "relation": "needs", "conclusion": "insulin", "snippet_id": "kb-002@5-40"},
    ]
    [cited] = cite("Evidence [2] says insulin.", triplet_items(triplets, SNIPPETS))
    assert cited["kind"] == "triplet" and cited["text"] == "oral failure — needs — insulin"
    assert (cited["snippet_id"], cited["doc_id"], cited["start"]) == ("kb-002@5-40", "kb-002", 5)


def test_opinions_are_cited_by_specialist_number():
    opinions = [
        {"specialist": 1, "specialty": "Cardiologist", "model": "m", "answer": "A", "reasoning": "x"},
        {"specialist": 2, "specialty": "Cardiologist", "model": "m", "answer": "B", "reasoning": "y"},
    ]
    citations = cite("Specialists 2 and 5 agree.", opinion_items(opinions))
    assert [(c["number"], c["shown"], c["kind"]) for c in citations] == [(2, True, "opinion"), (5, False, None)]


def test_at_most_max_citations_are_kept():
    reasoning = " ".join(f"[{n}]" for n in range(1, 200))
    assert citation_keys(reasoning) == list(range(1, MAX_CITATIONS + 1))


@pytest.mark.parametrize(
    "hostile",
    [
        "[" * 1_000_000,
        "[1," * 300_000,
        "evidence " * 200_000,
        "[" + "a" * 199 + "[" * 500_000,
        "documents 1 and " * 100_000,
    ],
)
def test_hostile_reasoning_is_read_in_bounded_time(hostile):
    started = time.process_time()
    cite(hostile, snippet_items(SNIPPETS))
    assert time.process_time() - started < 2.0
