"""What every graph's state shares: the input (a question, its options, the gold answer when known), how it is
checked (`validate_question`: option keys are single letters, every option has text), and the reducer of
per-question channels."""

from __future__ import annotations

import operator
from typing import Annotated, Any, Callable, Mapping

from typing_extensions import TypedDict  # pydantic (Studio's schemas) rejects typing.TypedDict on Python < 3.12

from ermedrag.agents.respondent import is_blank

MAX_OPTIONS = 26
OPTION_KEYS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


class InputState(TypedDict, total=False):
    question: str
    options: dict[str, str] | None
    gold: str | None
    run_id: str


def validate_question(state: Mapping[str, Any]) -> tuple[str, dict[str, str] | None]:
    """The question and options of the input, or a ValueError that names what is wrong."""
    question = state.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ValueError("input 'question' must be a non-empty string")
    options = state.get("options")
    if options is None or options == {}:
        return question.strip(), None
    if not isinstance(options, Mapping):
        raise ValueError(f"input 'options' must be a mapping like {{'A': '...'}}, got {type(options).__name__}")
    if len(options) > MAX_OPTIONS:
        raise ValueError(f"input 'options' has {len(options)} entries; at most {MAX_OPTIONS}")
    clean: dict[str, str] = {}
    given: dict[str, Any] = {}
    for key, text in options.items():
        letter = canonical_option_key(key)
        if letter in given:
            raise ValueError(
                f"input 'options' has both {given[letter]!r} and {key!r}: option keys are letters "
                f"A-Z and a lowercase key is the same option as its uppercase one"
            )
        if not isinstance(text, (str, int, float)):
            raise ValueError(
                f"input 'options' entry {key!r}: keys must be non-empty strings, values text "
                f"(this value is a {type(text).__name__})"
            )
        if is_blank(str(text)):  # no answer could name it by text, and an empty answer would match it
            raise ValueError(f"input 'options' entry {key!r}: the option's text is empty (or only punctuation)")
        given[letter], clean[letter] = key, str(text)
    return question.strip(), clean


def canonical_option_key(key: Any) -> str:
    """An option key as every part downstream sees it: one uppercase letter A-Z ('b' and ' B ' are 'B'), or a
    ValueError naming the key. Answers are parsed into, and gold answers compared with, these keys."""
    letter = key.strip().upper() if isinstance(key, str) else None
    if letter is None or len(letter) != 1 or letter not in OPTION_KEYS:
        raise ValueError(f"input 'options' key {key!r}: option keys are single letters A-Z (e.g. 'A', 'B')")
    return letter


def per_question(combine: Callable[[Any, Any], Any], empty: Callable[[], Any] = list) -> Callable[[Any, Any], Any]:
    """A state channel's reducer that combines updates with `combine` and starts over on None: `begin_run` sends
    None to each such channel (`fresh`), so a new question on a thread that answered one before (Studio, a
    reused `thread_id`) never inherits its documents, opinions, segments or timings."""

    def reduce(current: Any, new: Any) -> Any:
        if new is None:
            return empty()
        return combine(empty() if current is None else current, new)

    return reduce


class RunState(InputState, total=False):
    """What every graph's state holds beside its input: each stage's own seconds (`timings`), and what loading took
    before the stages (`setup`, `graphs.steps.prepare`)."""

    timings: Annotated[dict[str, float], per_question(operator.or_, dict)]
    setup: dict[str, float]
