"""MMedAgent-RL: a triage doctor picks a specialty, N specialists answer, an attending physician decides.

    intake ─► [retrieve] ─► triage ─► specialist ×N ─► collect ─► attending ×M ─► finish

`triage` asks the triage model for one specialty of the list (or takes the case's gold specialty, or a fixed
one: `triage_mode`); each `specialist` is one recorded call with the same prompt (independent opinions: they
differ only by sampling); `collect` computes the specialists' agreement with the gold answer, the curriculum
bucket and their majority; `attending` reads the opinions (defused) and answers, M times when
`attending_samples` > 1 (then a majority vote); `finish` closes the run. With `specialist_retrieval` the
question's evidence is retrieved once (ER-MedRAG's retrieval, recorded) and every specialist reads it.

    graph.invoke({"question": "...", "options": {"A": "...", "B": "..."}, "gold": "B"},
                 context={"respondent_model": "openai:Qwen/Qwen3-8B", "n_specialists": 3})

Images: the input's `images` (file paths, http(s) URLs or data URIs; at most 8) are checked in `intake` and go,
as references, to every role: the triage doctor, each specialist and the attending see them with the case. Every
role's model must be able to see (`tools.chat_models.require_image_support`): one that cannot (a text-only hf
model, offline:gemma3-270m, a scripted model without `?vision=1`, openai: with ERMEDRAG_OPENAI_VISION=0) refuses
the question in `intake`, naming the role's context field, before a run is opened or any weights load. A data URI
is written once to the image cache (`tools.images.cache_data_uris`: <ERMEDRAG_HOME>/images/<sha256>.<ext>) and the
state, every fan-out task and every checkpoint carry its path, never the base64. File paths are read only inside
the allowed image folders (env ERMEDRAG_IMAGE_ROOTS: `tools.images.image_roots`). Traces keep the images as
references with their sha256 (a data URI as `data:<mime>;sha256=<hash>`), never the pixels.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from langgraph.graph import END, START, StateGraph
from langgraph.runtime import Runtime
from langgraph.types import Send
from typing_extensions import TypedDict

from ermedrag.agents import mmedagent as roles
from ermedrag.agents.mmedagent import Opinion, Triage
from ermedrag.agents.respondent import Answer, render_snippets
from ermedrag.graphs.common import (Context, answer_call, begin_run, env, env_bool, env_int, per_question,
                                   record_call, retrieve_evidence, trace_store)
from ermedrag.graphs.er_medrag import InputState
from ermedrag.tools.chat_models import require_image_support
from ermedrag.tools.images import cache_data_uris, validate_images

GRAPH_NAME = "mmedagent"


@dataclass(kw_only=True)
class MMedAgentContext(Context):
    specialties: str = env("ERMEDRAG_SPECIALTIES", ", ".join(roles.SPECIALTIES))
    """Specialties the triage doctor chooses from, comma-separated (the paper's seven by default).
    Env ERMEDRAG_SPECIALTIES."""
    triage_mode: str = env("ERMEDRAG_TRIAGE_MODE", "model")
    """'model' (the triage model chooses), 'oracle' (the input's gold_specialty) or 'fixed:NAME' (always NAME).
    Env ERMEDRAG_TRIAGE_MODE."""
    default_specialty: str = env("ERMEDRAG_DEFAULT_SPECIALTY", "")
    """The specialty used when triage names none of the list (recorded as a fallback); empty = the first of
    `specialties`. Env ERMEDRAG_DEFAULT_SPECIALTY."""
    n_specialists: int = env_int("ERMEDRAG_N_SPECIALISTS", 3)
    """Specialists consulted per question, 1-16 (the paper: three). Identical prompts: at temperature 0 they
    agree. Env ERMEDRAG_N_SPECIALISTS."""
    attending_samples: int = env_int("ERMEDRAG_ATTENDING_SAMPLES", 1)
    """Attending calls per question, 1-16; above 1 the answer is their majority vote (ties: the answer given
    first). Env ERMEDRAG_ATTENDING_SAMPLES."""
    triage_model: str = env("ERMEDRAG_TRIAGE_MODEL", "")
    """Triage doctor's chat model; empty = respondent_model. Env ERMEDRAG_TRIAGE_MODEL."""
    specialist_model: str = env("ERMEDRAG_SPECIALIST_MODEL", "")
    """Specialists' chat model (the paper: a frozen strong model); empty = respondent_model.
    Env ERMEDRAG_SPECIALIST_MODEL."""
    attending_model: str = env("ERMEDRAG_ATTENDING_MODEL", "")
    """Attending physician's chat model; empty = respondent_model. Env ERMEDRAG_ATTENDING_MODEL."""
    specialist_retrieval: bool = env_bool("ERMEDRAG_SPECIALIST_RETRIEVAL", False)
    """Retrieve the question's evidence once (index_dir, snippets_k, coarse_k, reranker) and show it to every
    specialist. Env ERMEDRAG_SPECIALIST_RETRIEVAL."""
    triage_max_new_tokens: int = env_int("ERMEDRAG_TRIAGE_MAX_NEW_TOKENS", roles.TRIAGE_MAX_NEW_TOKENS)
    """Generation budget of the triage call. Env ERMEDRAG_TRIAGE_MAX_NEW_TOKENS."""
    specialist_max_new_tokens: int = env_int("ERMEDRAG_SPECIALIST_MAX_NEW_TOKENS", roles.SPECIALIST_MAX_NEW_TOKENS)
    """Generation budget of one specialist call. Env ERMEDRAG_SPECIALIST_MAX_NEW_TOKENS."""
    attending_max_new_tokens: int = env_int("ERMEDRAG_ATTENDING_MAX_NEW_TOKENS", roles.ATTENDING_MAX_NEW_TOKENS)
    """Generation budget of one attending call. Env ERMEDRAG_ATTENDING_MAX_NEW_TOKENS."""

    def __post_init__(self) -> None:
        super().__post_init__()
        # Read through vars(): checking a value is not using it (what a run reads is what its results are keyed by).
        values = vars(self)
        known = roles.parse_specialties(values["specialties"])
        triage_mode, default = str(values["triage_mode"]), str(values["default_specialty"])
        mode, name = roles.split_triage_mode(triage_mode)
        if mode not in ("model", "oracle", "fixed") or (mode == "fixed") != bool(name):
            raise ValueError(f"context field 'triage_mode' is {triage_mode!r}; use one of "
                             f"{', '.join(roles.TRIAGE_MODES)}")
        if mode == "fixed" and not roles.canonical_specialty(name, known):
            raise ValueError(f"context field 'triage_mode': {name!r} is not one of the specialties "
                             f"({', '.join(known)})")
        if default.strip() and not roles.canonical_specialty(default, known):
            raise ValueError(f"context field 'default_specialty': {default!r} is not one of the "
                             f"specialties ({', '.join(known)})")
        for field_name, most in (("n_specialists", roles.MAX_SPECIALISTS),
                                 ("attending_samples", roles.MAX_ATTENDING_SAMPLES)):
            value = values[field_name]
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
                raise ValueError(f"context field {field_name!r} must be an integer from 1 to {most}, got {value!r}")


def specialty_list(ctx: MMedAgentContext) -> tuple[str, ...]:
    return roles.parse_specialties(ctx.specialties)


def fallback_specialty(ctx: MMedAgentContext) -> str:
    known = specialty_list(ctx)
    return roles.canonical_specialty(ctx.default_specialty, known) or known[0]


def role_model(ctx: MMedAgentContext, spec: str) -> str:
    return spec or ctx.respondent_model


class MMedAgentInput(InputState, total=False):
    gold_specialty: str | None  # the case's specialty, when known: the oracle triage and the triage's gold label
    # File paths, http(s) URLs or data:image/...;base64 URIs (at most 8): every role sees them. After `intake` the
    # state holds a data URI as the path of its file in the image cache.
    images: list[str] | None


class AttendingSample(TypedDict):
    sample: int  # 0..M-1
    answer: Answer


def by_specialist(current: list[Opinion], new: list[Opinion]) -> list[Opinion]:
    """Concatenate, kept in specialist order (the fan-out finishes in any order)."""
    return sorted(current + new, key=lambda o: o["specialist"])


def by_sample(current: list[AttendingSample], new: list[AttendingSample]) -> list[AttendingSample]:
    return sorted(current + new, key=lambda s: s["sample"])


class State(MMedAgentInput, total=False):
    snippets: list[dict[str, Any]]  # the specialists' evidence (specialist_retrieval only)
    evidence: str | None
    specialty: str  # the chosen specialty
    triage: Triage
    opinions: Annotated[list[Opinion], per_question(by_specialist)]
    attending_answers: Annotated[list[AttendingSample], per_question(by_sample)]
    answer: Answer
    agreement: float | None  # share of specialists whose answer is the gold one (None without gold)
    bucket: roles.Bucket | None
    majority: str | None  # the specialists' most common answer (None on a tie)
    followed_majority: bool | None
    timings: Annotated[dict[str, float], per_question(operator.or_, dict)]
    stage_started_at: float


class SpecialistTask(TypedDict):
    run_id: str
    question: str
    options: dict[str, str] | None
    gold: str | None
    specialty: str
    specialist: int
    evidence: str | None
    images: list[str]  # as the state holds them after intake: paths and URLs, never a data URI's base64


class AttendingTask(TypedDict):
    run_id: str
    question: str
    options: dict[str, str] | None
    gold: str | None
    opinions: list[Opinion]
    sample: int
    images: list[str]


def _check_extra_input(state: State) -> list[str]:
    """The input's images (checked: `tools.images.validate_images`); a ValueError naming the field otherwise."""
    gold_specialty = state.get("gold_specialty")
    if gold_specialty is not None and not isinstance(gold_specialty, str):
        raise ValueError(f"input 'gold_specialty' must be a string, got {type(gold_specialty).__name__}")
    return validate_images(state.get("images"))


def seeing_roles(ctx: MMedAgentContext) -> list[tuple[str, str, str]]:
    """(role, context field, model spec) of every role whose model is shown the images: the triage doctor (when
    a model triages), the specialists, the attending. An empty role field means respondent_model."""
    roles_fields = [("specialist", "specialist_model"), ("attending", "attending_model")]
    if roles.split_triage_mode(ctx.triage_mode)[0] == "model":
        roles_fields.insert(0, ("triage doctor", "triage_model"))
    return [(role, field if getattr(ctx, field) else "respondent_model", role_model(ctx, getattr(ctx, field)))
            for role, field in roles_fields]


def check_models_see(ctx: MMedAgentContext, images: list[str]) -> None:
    """Every role that will be shown the images can see them, or an error naming the role's field and model."""
    for role, field, spec in seeing_roles(ctx):
        require_image_support(spec, images, who=f"input 'images': the {role}'s ", setting=f"context field {field!r}")


def intake(state: State, runtime: Runtime[MMedAgentContext]) -> dict[str, Any]:
    images = _check_extra_input(state)
    check_models_see(runtime.context, images)
    # Written once, passed on as paths: the tasks of each fan-out and every later checkpoint stay small.
    fresh = ("timings", "opinions", "attending_answers")
    return begin_run(state, runtime.context, GRAPH_NAME, fresh) | {"images": cache_data_uris(images)}


def after_intake(state: State, runtime: Runtime[MMedAgentContext]) -> Literal["retrieve", "triage"]:
    return "retrieve" if runtime.context.specialist_retrieval else "triage"


def retrieve(state: State, runtime: Runtime[MMedAgentContext]) -> dict[str, Any]:
    """The question's evidence, retrieved once for all specialists (recorded as a retrieval event)."""
    update = retrieve_evidence(runtime.context, state["question"], run_id=state["run_id"], node="retrieve")
    return update | {"evidence": render_snippets(update["snippets"])}


def triage(state: State, runtime: Runtime[MMedAgentContext]) -> dict[str, Any]:
    ctx = runtime.context
    known, fallback = specialty_list(ctx), fallback_specialty(ctx)
    mode, name = roles.split_triage_mode(ctx.triage_mode)
    started = time.perf_counter()
    if mode == "fixed":
        chosen = roles.fixed_triage(roles.canonical_specialty(name, known) or fallback)
    elif mode == "oracle":
        chosen = roles.oracle_triage(state.get("gold_specialty"), known, fallback)
    else:
        chosen, _ = record_call(
            ctx, role_model(ctx, ctx.triage_model), ctx.triage_max_new_tokens,
            roles.triage_messages(state["question"], state.get("options"), known, state.get("images") or []),
            lambda completion: roles.parse_triage(completion, known, fallback),
            agent="triage", node="triage", run_id=state["run_id"], gold=state.get("gold_specialty"),
            stop=roles.STOP, inputs={"question": state["question"], "options": state.get("options"),
                                     "specialties": list(known)},
        )
    return {"specialty": chosen["specialty"], "triage": chosen, "stage_started_at": time.time(),
            "timings": {"triage_s": time.perf_counter() - started}}


def consult_specialists(state: State, runtime: Runtime[MMedAgentContext]) -> list[Send]:
    return [
        Send("specialist", SpecialistTask(run_id=state["run_id"], question=state["question"],
                                          options=state.get("options"), gold=state.get("gold"),
                                          specialty=state["specialty"], specialist=i, evidence=state.get("evidence"),
                                          images=state.get("images") or []))
        for i in range(1, runtime.context.n_specialists + 1)
    ]


def specialist(task: SpecialistTask, runtime: Runtime[MMedAgentContext]) -> dict[str, Any]:
    ctx = runtime.context
    model = role_model(ctx, ctx.specialist_model)
    answer = answer_call(
        ctx, model, ctx.specialist_max_new_tokens,
        roles.specialist_messages(task["specialty"], task["question"], task["options"], task["evidence"],
                                  task["images"]), task, agent="specialist", node="specialist",
        inputs={"question": task["question"], "options": task["options"], "specialty": task["specialty"],
                "specialist": task["specialist"], "evidence": task["evidence"]},
    )
    return {"opinions": [roles.opinion(task["specialist"], task["specialty"], model, answer)]}


def collect(state: State) -> dict[str, Any]:
    """The specialists' statistics: agreement with the gold answer, curriculum bucket, majority."""
    answers = [o["answer"] for o in state.get("opinions", [])]
    agreement = roles.specialist_agreement(answers, state.get("gold"))
    return {"agreement": agreement, "bucket": roles.bucket(agreement), "majority": roles.majority(answers),
            "stage_started_at": time.time(),
            "timings": {"specialists_s": time.time() - state["stage_started_at"]}}


def consult_attending(state: State, runtime: Runtime[MMedAgentContext]) -> list[Send]:
    return [
        Send("attending", AttendingTask(run_id=state["run_id"], question=state["question"],
                                        options=state.get("options"), gold=state.get("gold"),
                                        opinions=state.get("opinions", []), sample=j,
                                        images=state.get("images") or []))
        for j in range(runtime.context.attending_samples)
    ]


def attending(task: AttendingTask, runtime: Runtime[MMedAgentContext]) -> dict[str, Any]:
    ctx = runtime.context
    model = role_model(ctx, ctx.attending_model)
    answer = answer_call(
        ctx, model, ctx.attending_max_new_tokens,
        roles.attending_messages(task["question"], task["options"], task["opinions"], task["images"]), task,
        agent="attending", node="attending",
        inputs={"question": task["question"], "options": task["options"], "opinions": task["opinions"],
                "sample": task["sample"]},
    )
    return {"attending_answers": [AttendingSample(sample=task["sample"], answer=answer)]}


def finish(state: State, runtime: Runtime[MMedAgentContext]) -> dict[str, Any]:
    samples = state.get("attending_answers", [])
    chosen = roles.vote([s["answer"]["answer"] for s in samples])
    answer = samples[chosen or 0]["answer"]
    followed = roles.followed_majority(answer["answer"], state.get("majority"))
    trace_store(runtime.context).finish_run(state["run_id"], dict(answer) | {
        "specialty": state.get("specialty"), "triage": state.get("triage"), "agreement": state.get("agreement"),
        "bucket": state.get("bucket"), "majority": state.get("majority"), "followed_majority": followed,
        "specialist_answers": [o["answer"] for o in state.get("opinions", [])],
        "attending_answers": [s["answer"]["answer"] for s in samples]})
    return {"answer": answer, "followed_majority": followed,
            "timings": {"attending_s": time.time() - state["stage_started_at"]}}


builder = StateGraph(State, context_schema=MMedAgentContext, input_schema=MMedAgentInput)
builder.add_node(intake)
builder.add_node(retrieve)
builder.add_node(triage)
builder.add_node(specialist)
builder.add_node(collect)
builder.add_node(attending)
builder.add_node(finish)
builder.add_edge(START, "intake")
builder.add_conditional_edges("intake", after_intake, ["retrieve", "triage"])
builder.add_edge("retrieve", "triage")
builder.add_conditional_edges("triage", consult_specialists, ["specialist"])
builder.add_edge("specialist", "collect")
builder.add_conditional_edges("collect", consult_attending, ["attending"])
builder.add_edge("attending", "finish")
builder.add_edge("finish", END)
graph = builder.compile(name="MMedAgent-RL")
