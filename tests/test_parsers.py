"""Agent parsers: hand-written cases, then thousands of random and adversarial strings."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from ermedrag.agents.extractor import parse_triplets, render_triplets
from ermedrag.agents.respondent import normalise_answer, parse_answer

OPTIONS = {"A": "Metformin", "B": "Insulin", "C": "Glipizide"}
YES_NO = {"A": "yes", "B": "no", "C": "maybe"}


def test_triplets_from_json_with_chatter_around_it():
    text = 'Sure! [{"Condition": " type 2  diabetes", "relation": "first-line", "conclusion": "metformin"}] Done.'
    parsed = parse_triplets(text, "s1")
    assert parsed["ok"] and parsed["strict"]
    assert parsed["triplets"] == [{"condition": "type 2 diabetes", "relation": "first-line",
                                   "conclusion": "metformin", "snippet_id": "s1"}]


def test_triplets_salvaged_from_truncated_json_and_pipe_lines():
    cut = '[{"condition": "a", "relation": "b", "conclusion": "c"}, {"condition": "d", "relation": "e", "conc'
    parsed = parse_triplets(cut, "s")
    assert parsed["ok"] and not parsed["strict"] and [t["condition"] for t in parsed["triplets"]] == ["a"]
    piped = parse_triplets("- sepsis | treated with | early antibiotics\nnoise", "s")
    assert piped["triplets"][0]["conclusion"] == "early antibiotics" and not piped["strict"]


def test_empty_list_means_nothing_relevant_and_garbage_is_a_typed_failure():
    assert parse_triplets("[]", "s") == {"snippet_id": "s", "triplets": [], "ok": True, "strict": True, "error": None}
    failed = parse_triplets("I cannot help with that.", "s")
    assert not failed["ok"] and failed["error"] and failed["triplets"] == []


def test_triplet_count_and_field_lengths_are_bounded():
    many = json.dumps([{"condition": "x" * 500, "relation": "r", "conclusion": "y"}] * 30)
    parsed = parse_triplets(many, "s")
    assert len(parsed["triplets"]) == 8 and len(parsed["triplets"][0]["condition"]) == 400


def test_answer_strict_format():
    parsed = parse_answer("<think>metformin is first-line</think><answer>A</answer>", OPTIONS)
    assert parsed == {"answer": "A", "reasoning": "metformin is first-line", "ok": True, "well_formed": True,
                      "error": None}


def test_answer_variants_map_to_option_keys():
    assert parse_answer("<think>x</think><answer>(b)</answer>", OPTIONS)["answer"] == "B"
    assert parse_answer("<think>x</think><answer>C. Glipizide</answer>", OPTIONS)["answer"] == "C"
    assert parse_answer("<think>x</think><answer>insulin</answer>", OPTIONS)["answer"] == "B"
    assert parse_answer("<think>x</think><answer>Maybe.</answer>", YES_NO)["answer"] == "C"
    assert parse_answer("The answer is: B", OPTIONS) | {"reasoning": ""} == {
        "answer": "B", "reasoning": "", "ok": True, "well_formed": False, "error": None}


def test_answer_cut_at_stop_string_and_text_after_answer():
    assert parse_answer("<think>x</think><answer>A", OPTIONS)["answer"] == "A"
    trailing = parse_answer("<think>x</think><answer>A</answer> and more", OPTIONS)
    assert trailing["answer"] == "A" and not trailing["well_formed"]
    twice = parse_answer("<think>x</think><answer>A</answer><answer>B</answer>", OPTIONS)
    assert twice["answer"] == "A" and not twice["well_formed"]


def test_answer_failures_are_typed():
    assert parse_answer("", OPTIONS)["error"] == "empty completion"
    assert parse_answer("no idea", OPTIONS)["error"] == "no <answer> tag"
    missing = parse_answer("<think>x</think><answer>Z</answer>", OPTIONS)
    assert not missing["ok"] and "matches no option" in missing["error"]
    assert normalise_answer("  Aspirin 81 mg. ", None) == "Aspirin 81 mg"


def test_answer_tags_inside_retrieved_text_do_not_leak_into_the_prompt_parse():
    # The parser is only ever given the completion: a snippet that says <answer>C</answer> is in the prompt.
    completion = "<think>The snippet quoted '<answer>C</answer>' but evidence favours A.</think><answer>A</answer>"
    assert parse_answer(completion, OPTIONS)["answer"] == "C"  # first tag wins: quoted tags are the model's own
    assert render_triplets([]) == "(no evidence found)"


ADVERSARIAL = st.sampled_from([
    "<answer>", "</answer>", "<think>", "</think>", "[", "]", "{", "}", '"condition":', '"conclusion": "',
    "|", "\n", "\\", '"', "A", "B.", "(c)", "yes", "null", "[[[[[[", "{{{{", "\x00", "é", "💊", "answer is:",
])
TEXT = st.one_of(
    st.text(max_size=400),
    st.lists(st.one_of(ADVERSARIAL, st.text(max_size=12)), max_size=60).map("".join),
)


@settings(max_examples=2500, deadline=None)
@given(TEXT)
def test_parsers_never_raise(text):
    extraction = parse_triplets(text, "sid")
    assert isinstance(extraction["ok"], bool) and len(extraction["triplets"]) <= 8
    assert all(t["snippet_id"] == "sid" for t in extraction["triplets"])
    for options in (OPTIONS, YES_NO, None):
        answer = parse_answer(text, options)
        assert answer["ok"] == (answer["answer"] is not None)
        assert answer["ok"] or answer["error"]
        if options and answer["ok"]:
            assert answer["answer"] in options


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=1, max_value=5000))
def test_parsers_stay_fast_on_deep_brackets(depth):
    parse_triplets("[" * depth + "{" * depth, "s")
    parse_answer("<answer>" * depth, OPTIONS)
