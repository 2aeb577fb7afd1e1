"""MMedAgent-RL's state: the input (a question, its options and images, the gold specialty when known), the
opinions and attending samples gathered from the fan-outs, and the tasks each fan-out sends."""

from __future__ import annotations

from typing import Annotated, Any

from typing_extensions import TypedDict

from ermedrag.agents import attending as attending_role
from ermedrag.agents.citations import EvidenceItem
from ermedrag.agents.specialist import Opinion
from ermedrag.agents.triage import Triage
from ermedrag.agents.respondent import Answer
from ermedrag.graphs.state import InputState, RunState, per_question


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


class State(MMedAgentInput, RunState, total=False):
    snippets: list[dict[str, Any]]  # the specialists' evidence (specialist_retrieval only)
    evidence: str | None
    shown: list[EvidenceItem]  # the evidence's snippets, numbered as the specialists see them
    specialty: str  # the chosen specialty
    triage: Triage
    opinions: Annotated[list[Opinion], per_question(by_specialist)]
    attending_answers: Annotated[list[AttendingSample], per_question(by_sample)]
    answer: Answer
    agreement: float | None  # share of specialists whose answer is the gold one (None without gold)
    bucket: attending_role.Bucket | None
    majority: str | None  # the specialists' most common answer (None on a tie)
    followed_majority: bool | None
    stage_started_at: float


class SpecialistTask(TypedDict):
    run_id: str
    question: str
    options: dict[str, str] | None
    gold: str | None
    specialty: str
    specialist: int
    evidence: str | None
    shown: list[EvidenceItem]
    images: list[str]  # as the state holds them after intake: paths and URLs, never a data URI's base64


class AttendingTask(TypedDict):
    run_id: str
    question: str
    options: dict[str, str] | None
    gold: str | None
    opinions: list[Opinion]
    sample: int
    images: list[str]
