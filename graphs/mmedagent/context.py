"""MMedAgent-RL's context: the specialties, how triage chooses, the panel's size and models, each field's budget;
and which roles' models must see the question's images."""

from __future__ import annotations

from dataclasses import dataclass


from ermedrag.agents import attending as attending_role, specialist as specialist_role, triage as triage_role
from ermedrag.graphs.context import Context
from ermedrag.tools.settings import context_field
from ermedrag.tools.models import require_image_support


@dataclass(kw_only=True)
class MMedAgentContext(Context):
    specialties: str = context_field("ERMEDRAG_SPECIALTIES")
    triage_mode: str = context_field("ERMEDRAG_TRIAGE_MODE")
    default_specialty: str = context_field("ERMEDRAG_DEFAULT_SPECIALTY")
    n_specialists: int = context_field("ERMEDRAG_N_SPECIALISTS")
    attending_samples: int = context_field("ERMEDRAG_ATTENDING_SAMPLES")
    triage_model: str = context_field("ERMEDRAG_TRIAGE_MODEL")
    specialist_model: str = context_field("ERMEDRAG_SPECIALIST_MODEL")
    attending_model: str = context_field("ERMEDRAG_ATTENDING_MODEL")
    specialist_retrieval: bool = context_field("ERMEDRAG_SPECIALIST_RETRIEVAL")
    triage_max_new_tokens: int = context_field("ERMEDRAG_TRIAGE_MAX_NEW_TOKENS")
    specialist_max_new_tokens: int = context_field("ERMEDRAG_SPECIALIST_MAX_NEW_TOKENS")
    attending_max_new_tokens: int = context_field("ERMEDRAG_ATTENDING_MAX_NEW_TOKENS")

    def __post_init__(self) -> None:
        super().__post_init__()
        # Read through vars(): checking a value is not using it (what a run reads is what its results are keyed by).
        values = vars(self)
        known = triage_role.parse_specialties(values["specialties"])
        triage_mode, default = str(values["triage_mode"]), str(values["default_specialty"])
        mode, name = triage_role.split_triage_mode(triage_mode)
        if mode not in ("model", "oracle", "fixed") or (mode == "fixed") != bool(name):
            raise ValueError(
                f"context field 'triage_mode' is {triage_mode!r}; use one of {', '.join(triage_role.TRIAGE_MODES)}"
            )
        if mode == "fixed" and not triage_role.canonical_specialty(name, known):
            raise ValueError(
                f"context field 'triage_mode': {name!r} is not one of the specialties ({', '.join(known)})"
            )
        if default.strip() and not triage_role.canonical_specialty(default, known):
            raise ValueError(
                f"context field 'default_specialty': {default!r} is not one of the specialties ({', '.join(known)})"
            )
        for field_name, most in (
            ("n_specialists", specialist_role.MAX_SPECIALISTS),
            ("attending_samples", attending_role.MAX_ATTENDING_SAMPLES),
        ):
            value = values[field_name]
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
                raise ValueError(f"context field {field_name!r} must be an integer from 1 to {most}, got {value!r}")


def specialty_list(ctx: MMedAgentContext) -> tuple[str, ...]:
    return triage_role.parse_specialties(ctx.specialties)


def fallback_specialty(ctx: MMedAgentContext) -> str:
    known = specialty_list(ctx)
    return triage_role.canonical_specialty(ctx.default_specialty, known) or known[0]


def role_model(ctx: MMedAgentContext, spec: str) -> str:
    return spec or ctx.respondent_model


def seeing_roles(ctx: MMedAgentContext) -> list[tuple[str, str, str]]:
    """(role, context field, model spec) of every role whose model is shown the images: the triage doctor (when
    a model triages), the specialists, the attending. An empty role field means respondent_model."""
    roles_fields = [("specialist", "specialist_model"), ("attending", "attending_model")]
    if triage_role.split_triage_mode(ctx.triage_mode)[0] == "model":
        roles_fields.insert(0, ("triage doctor", "triage_model"))
    return [
        (role, field if getattr(ctx, field) else "respondent_model", role_model(ctx, getattr(ctx, field)))
        for role, field in roles_fields
    ]


def check_models_see(ctx: MMedAgentContext, images: list[str]) -> None:
    """Every role that will be shown the images can see them, or an error naming the role's field and model."""
    for role, field, spec in seeing_roles(ctx):
        require_image_support(spec, images, who=f"input 'images': the {role}'s ", setting=f"context field {field!r}")
