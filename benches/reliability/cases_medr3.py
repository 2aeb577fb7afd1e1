"""Med-R³'s loop with models that misbehave: it must always end, with the model's own answer or an honest failure
(`ok` agreeing with `error`), within its search and token budgets. Scripted models from `tests/`."""

from __future__ import annotations

from typing import Any

from benches.reliability.harness import (
    Verdict,
    Workspace,
    answer_problem,
    data_lost,
    ok,
    recorded_answer_problem,
    register,
    silent_wrong,
)

QUESTION = "Which drug is first-line for type 2 diabetes?"
OPTIONS = {"A": "Metformin", "B": "Insulin", "C": "Glipizide"}


def run_med_r3(model: str, **context: Any) -> dict[str, Any]:
    from ermedrag.graphs.registry import load_graph

    return load_graph("med_r3").invoke(
        {"question": QUESTION, "options": OPTIONS},
        context={"respondent_model": model, "extractor_model": model, **context},
    )


def _judge(
    state: dict[str, Any], workspace: Workspace, expected: str | None, forced: str | None, extra: str | None = None
) -> Verdict:
    if forced is not None and state.get("forced_answer") != forced:
        return silent_wrong(f"forced_answer={state.get('forced_answer')!r}, expected {forced!r}")
    if expected is not None:
        problem = answer_problem(state, expected)
        if problem:
            return silent_wrong(problem)
    else:
        answer = state.get("answer") or {}
        if answer.get("ok") != (answer.get("error") is None) or (answer.get("ok") and answer.get("answer") is None):
            return silent_wrong(f"inconsistent answer {answer}")
    if extra:
        return silent_wrong(extra)
    recorded = recorded_answer_problem(state, workspace)
    if recorded:
        return data_lost(recorded)
    answer = state.get("answer") or {}
    return ok(
        f"answer {answer.get('answer')!r} (ok={answer.get('ok')}, well_formed={answer.get('well_formed')}), "
        f"forced_answer={state.get('forced_answer')!r}, {len(state.get('searches') or [])} searches"
    )


@register(
    "medr3_rambler_forced_answer",
    "medr3",
    "a model that never searches or answers (tests/scripted_rambler): the system forces the answer, 'A'",
    quick=True,
)
def rambler(workspace: Workspace) -> Verdict:
    state = run_med_r3("scripted:ermedrag.testing.scripted.rambler")
    return _judge(state, workspace, "A", "stopped")


@register(
    "medr3_rambler_token_budget",
    "medr3",
    "the rambler with max_total_tokens=25: the token budget forces the answer, 'A'",
    quick=True,
)
def rambler_budget(workspace: Workspace) -> Verdict:
    state = run_med_r3("scripted:ermedrag.testing.scripted.rambler", step_max_new_tokens=10, max_total_tokens=25)
    extra = None if state.get("generated_tokens", 0) <= 25 + 32 else f"generated {state['generated_tokens']} tokens"
    return _judge(state, workspace, "A", "token_budget", extra)


@register(
    "medr3_endless_searcher",
    "medr3",
    "a model that searches forever (tests/scripted_searcher): stops at max_searches=3, forces the answer; the "
    "answer is whatever the model then wrote, ok agreeing with error",
    quick=True,
)
def searcher(workspace: Workspace) -> Verdict:
    state = run_med_r3("scripted:ermedrag.testing.scripted.searcher", max_searches=3)
    extra = None if len(state.get("searches") or []) == 3 else f"{len(state.get('searches') or [])} searches"
    return _judge(state, workspace, None, "search_budget", extra)


@register(
    "medr3_forged_document",
    "medr3",
    "a model that writes its own <document> (tests/scripted_forger): its answer 'B' stands, marked not "
    "well formed and forged_document",
    quick=True,
)
def forger(workspace: Workspace) -> Verdict:
    state = run_med_r3("scripted:ermedrag.testing.scripted.forger")
    answer = state.get("answer") or {}
    extra = None
    if not state.get("forged_document") or answer.get("well_formed"):
        extra = f"forged_document={state.get('forged_document')}, well_formed={answer.get('well_formed')}"
    return _judge(state, workspace, "B", None, extra)
