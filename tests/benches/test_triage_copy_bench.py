"""The triage-copy bench's pieces: the example's specialty read from the real prompt, and the keyword baseline."""

from __future__ import annotations

from benches.learning.triage_copy import example_specialty, keyword_specialty
from ermedrag.agents import triage


def test_the_example_specialty_is_read_from_the_prompt_and_is_not_listed():
    messages = triage.triage_messages("A rash on both elbows: which specialty?", None, triage.SPECIALTIES)
    shown = example_specialty(messages)
    assert shown in triage.TRIAGE_EXAMPLES and shown not in triage.SPECIALTIES
    assert example_specialty(triage.triage_messages("Any?", None, tuple(triage.TRIAGE_EXAMPLES))) is None


def test_the_keyword_rule_names_the_specialty_whose_words_the_case_uses_most():
    listed = list(triage.SPECIALTIES)
    assert keyword_specialty("A skin rash with silvery plaques; a biopsy was taken.", listed) == "Dermatologist"
    assert keyword_specialty("Low TSH, high T4: the thyroid.", listed) == "Endocrinologist"
    assert keyword_specialty("Nothing that any rule knows.", listed) == listed[0]  # no hit: the first listed
