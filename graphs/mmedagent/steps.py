"""MMedAgent-RL's nodes: intake (input and images checked), retrieve, triage, the specialists' fan-out, collect,
the attending's fan-out, finish."""

from __future__ import annotations

import time
from typing import Any, Literal

from langgraph.runtime import Runtime
from langgraph.types import Send

from ermedrag.agents import attending as attending_role, specialist as specialist_role, triage as triage_role
from ermedrag.agents.citations import opinion_items, snippet_items
from ermedrag.agents.respondent import render_snippets
from ermedrag.graphs.steps import answer_call, begin_run, record_call, retrieve_evidence, trace_store
from ermedrag.tools.images import cache_data_uris, validate_images

from ermedrag.graphs.mmedagent.context import (
    MMedAgentContext,
    check_models_see,
    fallback_specialty,
    role_model,
    specialty_list,
)
from ermedrag.graphs.mmedagent.state import AttendingSample, AttendingTask, SpecialistTask, State

GRAPH_NAME = "mmedagent"


def _check_extra_input(state: State) -> list[str]:
    """The input's images (checked: `tools.images.validate_images`); a ValueError naming the field otherwise."""
    gold_specialty = state.get("gold_specialty")
    if gold_specialty is not None and not isinstance(gold_specialty, str):
        raise ValueError(f"input 'gold_specialty' must be a string, got {type(gold_specialty).__name__}")
    return validate_images(state.get("images"))


def intake(state: State, runtime: Runtime[MMedAgentContext]) -> dict[str, Any]:
    images = _check_extra_input(state)
    check_models_see(runtime.context, images)
    # Written once, passed on as paths: the tasks of each fan-out and every later checkpoint stay small.
    fresh = ("timings", "opinions", "attending_answers", "evidence", "shown")  # nothing of an earlier question
    return begin_run(state, runtime.context, GRAPH_NAME, fresh) | {"images": cache_data_uris(images)}


def after_intake(state: State, runtime: Runtime[MMedAgentContext]) -> Literal["retrieve", "triage"]:
    return "retrieve" if runtime.context.specialist_retrieval else "triage"


def retrieve(state: State, runtime: Runtime[MMedAgentContext]) -> dict[str, Any]:
    """The question's evidence, retrieved once for all specialists (recorded as a retrieval event)."""
    update = retrieve_evidence(runtime.context, state["question"], run_id=state["run_id"], node="retrieve")
    return update | {"evidence": render_snippets(update["snippets"]), "shown": snippet_items(update["snippets"])}


def triage(state: State, runtime: Runtime[MMedAgentContext]) -> dict[str, Any]:
    ctx = runtime.context
    known, fallback = specialty_list(ctx), fallback_specialty(ctx)
    mode, name = triage_role.split_triage_mode(ctx.triage_mode)
    started = time.perf_counter()
    if mode == "fixed":
        chosen = triage_role.fixed_triage(triage_role.canonical_specialty(name, known) or fallback)
    elif mode == "oracle":
        chosen = triage_role.oracle_triage(state.get("gold_specialty"), known, fallback)
    else:
        chosen, _ = record_call(
            ctx,
            role_model(ctx, ctx.triage_model),
            ctx.triage_max_new_tokens,
            triage_role.triage_messages(state["question"], state.get("options"), known, state.get("images") or []),
            lambda completion: triage_role.parse_triage(completion, known, fallback),
            agent="triage",
            node="triage",
            run_id=state["run_id"],
            gold=state.get("gold_specialty"),
            stop=triage_role.STOP,
            inputs={"question": state["question"], "options": state.get("options"), "specialties": list(known)},
        )
    return {
        "specialty": chosen["specialty"],
        "triage": chosen,
        "stage_started_at": time.time(),
        "timings": {"triage_s": time.perf_counter() - started},
    }


def consult_specialists(state: State, runtime: Runtime[MMedAgentContext]) -> list[Send]:
    return [
        Send(
            "specialist",
            SpecialistTask(
                run_id=state["run_id"],
                question=state["question"],
                options=state.get("options"),
                gold=state.get("gold"),
                specialty=state["specialty"],
                specialist=i,
                evidence=state.get("evidence"),
                shown=state.get("shown") or [],
                images=state.get("images") or [],
            ),
        )
        for i in range(1, runtime.context.n_specialists + 1)
    ]


def specialist(task: SpecialistTask, runtime: Runtime[MMedAgentContext]) -> dict[str, Any]:
    ctx = runtime.context
    model = role_model(ctx, ctx.specialist_model)
    answer = answer_call(
        ctx,
        model,
        ctx.specialist_max_new_tokens,
        specialist_role.specialist_messages(
            task["specialty"], task["question"], task["options"], task["evidence"], task["images"]
        ),
        task,
        agent="specialist",
        node="specialist",
        inputs={
            "question": task["question"],
            "options": task["options"],
            "specialty": task["specialty"],
            "specialist": task["specialist"],
            "evidence": task["evidence"],
        },
        shown=task.get("shown") or [],
    )
    return {"opinions": [specialist_role.opinion(task["specialist"], task["specialty"], model, answer)]}


def collect(state: State) -> dict[str, Any]:
    """The specialists' statistics: agreement with the gold answer, curriculum bucket, majority."""
    answers = [o["answer"] for o in state.get("opinions", [])]
    agreement = attending_role.specialist_agreement(answers, state.get("gold"))
    return {
        "agreement": agreement,
        "bucket": attending_role.bucket(agreement),
        "majority": attending_role.majority(answers),
        "stage_started_at": time.time(),
        "timings": {"specialists_s": time.time() - state["stage_started_at"]},
    }


def consult_attending(state: State, runtime: Runtime[MMedAgentContext]) -> list[Send]:
    return [
        Send(
            "attending",
            AttendingTask(
                run_id=state["run_id"],
                question=state["question"],
                options=state.get("options"),
                gold=state.get("gold"),
                opinions=state.get("opinions", []),
                sample=j,
                images=state.get("images") or [],
            ),
        )
        for j in range(runtime.context.attending_samples)
    ]


def attending(task: AttendingTask, runtime: Runtime[MMedAgentContext]) -> dict[str, Any]:
    ctx = runtime.context
    model = role_model(ctx, ctx.attending_model)
    answer = answer_call(
        ctx,
        model,
        ctx.attending_max_new_tokens,
        attending_role.attending_messages(task["question"], task["options"], task["opinions"], task["images"]),
        task,
        agent="attending",
        node="attending",
        inputs={
            "question": task["question"],
            "options": task["options"],
            "opinions": task["opinions"],
            "sample": task["sample"],
        },
        shown=opinion_items(task["opinions"]),
        score=True,
    )
    return {"attending_answers": [AttendingSample(sample=task["sample"], answer=answer)]}


def finish(state: State, runtime: Runtime[MMedAgentContext]) -> dict[str, Any]:
    samples = state.get("attending_answers", [])
    chosen = attending_role.vote([s["answer"]["answer"] for s in samples])
    answer = samples[chosen or 0]["answer"]
    followed = attending_role.followed_majority(answer["answer"], state.get("majority"))
    trace_store(runtime.context).finish_run(
        state["run_id"],
        dict(answer)
        | {
            "specialty": state.get("specialty"),
            "triage": state.get("triage"),
            "agreement": state.get("agreement"),
            "bucket": state.get("bucket"),
            "majority": state.get("majority"),
            "followed_majority": followed,
            "specialist_answers": [o["answer"] for o in state.get("opinions", [])],
            "attending_answers": [s["answer"]["answer"] for s in samples],
        },
    )
    return {
        "answer": answer,
        "followed_majority": followed,
        "timings": {"attending_s": time.time() - state["stage_started_at"]},
    }
