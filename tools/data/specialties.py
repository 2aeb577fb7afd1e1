"""Which specialty a benchmark question belongs to, from the benchmark's own metadata: the gold label of
MMedAgent-RL's triage (`graphs.mmedagent`), read by the eval (triage accuracy) and the training export.

The mapping table (the paper's seven specialties, `agents.triage.SPECIALTIES`; text benchmarks have no
triage labels, so these come from each benchmark's own subject metadata):

| benchmark (field) | value | specialty |
|---|---|---|
| MedMCQA (`subject`) | Pathology | Pathologist |
| | Radiology | Radiologist (MedMCQA's Radiology also holds radiotherapy questions) |
| | Surgery, Orthopaedics | Surgeon (orthopaedic surgery is surgery) |
| | Ophthalmology | Ophthalmologist |
| | Skin | Dermatologist |
| | Anaesthesia, Anatomy, Biochemistry, Dental, ENT, Forensic Medicine, Gynaecology & Obstetrics, Medicine, Microbiology, Pediatrics, Pharmacology, Physiology, Psychiatry, Social & Preventive Medicine, Unknown | None |
| MedXpertQA (`body_system`) | Endocrine | Endocrinologist |
| | Integumentary | Dermatologist |
| | Cardiovascular, Digestive, Lymphatic, Muscular, Nervous, Reproductive, Respiratory, Skeletal, Urinary, Other / NA | None |
| MMLU-Med (`subject`) | anatomy, clinical_knowledge, college_biology, college_medicine, medical_genetics, professional_medicine | None |
| any other benchmark (MedQA, PubMedQA, BioASQ, MMLU-Pro, GPQA) | | None |

A value not in the table is None too (a new subject is never mapped by resemblance). None of these sources
labels an Oncologist case: with the paper's list, triage data has no Oncologist rows unless the runs' inputs
carried `gold_specialty`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MAX_LABEL_CHARS = 200  # a metadata value longer than this is no subject name

MEDMCQA_SUBJECT_SPECIALTY: dict[str, str | None] = {
    "Pathology": "Pathologist",
    "Radiology": "Radiologist",
    "Surgery": "Surgeon",
    "Orthopaedics": "Surgeon",
    "Ophthalmology": "Ophthalmologist",
    "Skin": "Dermatologist",
    **dict.fromkeys(
        (
            "Anaesthesia",
            "Anatomy",
            "Biochemistry",
            "Dental",
            "ENT",
            "Forensic Medicine",
            "Gynaecology & Obstetrics",
            "Medicine",
            "Microbiology",
            "Pediatrics",
            "Pharmacology",
            "Physiology",
            "Psychiatry",
            "Social & Preventive Medicine",
            "Unknown",
        )
    ),
}
MEDXPERTQA_BODY_SYSTEM_SPECIALTY: dict[str, str | None] = {
    "Endocrine": "Endocrinologist",
    "Integumentary": "Dermatologist",
    **dict.fromkeys(
        (
            "Cardiovascular",
            "Digestive",
            "Lymphatic",
            "Muscular",
            "Nervous",
            "Reproductive",
            "Respiratory",
            "Skeletal",
            "Urinary",
            "Other / NA",
        )
    ),
}
MMLU_SUBJECT_SPECIALTY: dict[str, str | None] = dict.fromkeys(
    (
        "anatomy",
        "clinical_knowledge",
        "college_biology",
        "college_medicine",
        "medical_genetics",
        "professional_medicine",
    )
)

# benchmark family → (where its label is: "subject" or a meta key, its table)
LABEL_TABLES: dict[str, tuple[str, dict[str, str | None]]] = {
    "medmcqa": ("subject", MEDMCQA_SUBJECT_SPECIALTY),
    "medxpertqa": ("body_system", MEDXPERTQA_BODY_SYSTEM_SPECIALTY),
    "mmlu_med": ("subject", MMLU_SUBJECT_SPECIALTY),
}
LABELLED_BENCHMARKS = tuple(LABEL_TABLES)  # the benchmarks whose files `--data` is searched in


def fold_label(text: Any) -> str:
    return " ".join(str(text or "")[:MAX_LABEL_CHARS].split()).casefold()


_FOLDED_TABLES = {family: {fold_label(k): v for k, v in table.items()} for family, (_, table) in LABEL_TABLES.items()}


def benchmark_family(benchmark: str, source: str = "") -> str | None:
    """Which table labels a question: by its benchmark name ('medmcqa', or a file stem like 'medmcqa_dev') or,
    failing that, the `source` field of the shared files ('MedMCQA', 'MedXpertQA-Text', 'MMLU-Med')."""
    name, src = fold_label(benchmark).replace("-", "_"), fold_label(source).replace("-", "_")
    for family, prefixes in (("medmcqa", ("medmcqa",)), ("medxpertqa", ("medxpertqa",)), ("mmlu_med", ("mmlu_med",))):
        if name.startswith(prefixes) or src.startswith(prefixes):
            return family
    return None


def question_field(question: Any, name: str) -> Any:
    """`name` of a `tools.benchmarks.Question` or a dict: the field itself, else the same key of its `meta`."""
    if isinstance(question, Mapping):
        value, meta = question.get(name), question.get("meta")
    else:
        value, meta = getattr(question, name, None), getattr(question, "meta", None)
    if value in (None, "") and isinstance(meta, Mapping):
        value = meta.get(name)
    return value


def gold_specialty_for(question: Any) -> str | None:
    """The specialty the question's benchmark metadata names (module docstring's table), or None: no table
    for its benchmark, a value the table maps to None, or a value the table does not know (never guessed).
    `question`: a `tools.benchmarks.Question` or a dict with `benchmark`, `subject`, `meta`."""
    family = benchmark_family(
        str(question_field(question, "benchmark") or ""), str(question_field(question, "source") or "")
    )
    if family is None:
        return None
    where, _ = LABEL_TABLES[family]
    value = question_field(question, where)
    return _FOLDED_TABLES[family].get(fold_label(value)) if isinstance(value, str) else None
