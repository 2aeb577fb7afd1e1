"""Every environment variable ermedrag reads, in one place: typed, with its default and a one-line help.

    read("ERMEDRAG_SNIPPETS_K")          # 4, or the variable's value as an int
    context_field("ERMEDRAG_SNIPPETS_K") # a context dataclass field: read when a context is built; Studio shows the help

One rule for every variable: unset or blank means the default; a value that does not parse (or is out of range) is
a ValueError naming the variable and what it takes. Paths have `~` expanded. The README's settings table is
`settings_table()` (a test fails when they drift), and the same help is each context field's description in
LangGraph Studio. Nothing else in the product reads `os.environ` for these names.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import Field, dataclass, field
from pathlib import Path
from typing import Any

from ermedrag.agents import attending, reasoner, specialist, triage

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
KINDS = ("str", "int", "float", "bool", "path")


@dataclass(frozen=True)
class Setting:
    """One environment variable. `default` None: unset (the reader decides, e.g. the cache folder); `fallback`: the
    variable read when this one is unset or blank."""

    name: str
    kind: str
    default: Any  # a callable: computed when read, and the table shows `shown`
    help: str
    concern: str
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] = ()
    fallback: str | None = None
    shown: str = ""


def _s(name: str, kind: str, default: Any, help: str, concern: str, **limits: Any) -> Setting:
    return Setting(name, kind, default, help, concern, **limits)


OFFLINE_LLAMACPP, OFFLINE_TRANSFORMERS = "llamacpp:gemma3-270m", "offline:gemma3-270m"


def default_model() -> str:
    """The offline model on the fastest in-process backend installed here: llama.cpp (the `llamacpp` extra, which
    `make demo` builds) answers the demo in about half the time transformers takes on a CPU
    (benches/results/first_answer.json); without it, transformers."""
    return OFFLINE_LLAMACPP if importlib.util.find_spec("llama_cpp") is not None else OFFLINE_TRANSFORMERS


SETTINGS: tuple[Setting, ...] = (
    # models and sampling
    _s(
        "ERMEDRAG_MODEL",
        "str",
        default_model,
        "Chat model of every agent, `provider:name` (hf:, offline:, llamacpp:, openai:, vllm:); by default the "
        "offline model on llama.cpp where llama-cpp-python is installed (`make demo` builds it), else on transformers.",
        "models",
        shown=f"`{OFFLINE_LLAMACPP}` or `{OFFLINE_TRANSFORMERS}`",
    ),
    _s("ERMEDRAG_EXTRACTOR_MODEL", "str", None, "The extractor's chat model.", "models", fallback="ERMEDRAG_MODEL"),
    _s("ERMEDRAG_RESPONDENT_MODEL", "str", None, "The respondent's chat model.", "models", fallback="ERMEDRAG_MODEL"),
    _s("ERMEDRAG_REASONER_MODEL", "str", "", "Med-R³'s reasoning model; empty = the respondent's.", "models"),
    _s(
        "ERMEDRAG_TEMPERATURE",
        "float",
        0.0,
        "Sampling temperature of every agent (0 = greedy).",
        "models",
        low=0.0,
        high=2.0,
    ),
    _s("ERMEDRAG_EXTRACTOR_MAX_NEW_TOKENS", "int", 96, "Generation budget of one extractor call.", "models", low=0),
    _s("ERMEDRAG_RESPONDENT_MAX_NEW_TOKENS", "int", 192, "Generation budget of the respondent.", "models", low=0),
    _s(
        "ERMEDRAG_ANSWER_EXTRACTION",
        "bool",
        True,
        "When a reply names no option, ask the model once more for the "
        "letter alone, from its own reasoning (marked `extracted`, never well formed).",
        "models",
    ),
    _s(
        "ERMEDRAG_ANSWER_SCORES",
        "bool",
        True,
        "Score each multiple-choice answer: one extra one-token call reads the option letters' "
        "log-probabilities where the answer was written (its `confidence`; conformal sets and abstention use it).",
        "models",
    ),
    _s(
        "ERMEDRAG_DEVICE",
        "str",
        "cpu",
        "Torch device of in-process models and encoders (cpu, cuda, cuda:1, mps).",
        "models",
    ),
    _s(
        "ERMEDRAG_DTYPE",
        "str",
        "auto",
        "Dtype of in-process models: auto (bfloat16 where the device computes it "
        "natively and the checkpoint is stored so), float32, bfloat16, float16.",
        "models",
        choices=("auto", "float32", "bfloat16", "float16"),
    ),
    _s(
        "ERMEDRAG_TORCH_THREADS",
        "int",
        None,
        "Torch threads of in-process models (default: torch's own); 1 on a shared CPU.",
        "models",
        low=1,
        high=4096,
    ),
    _s("ERMEDRAG_HF_MAX_BATCH", "int", 8, "Calls the hf backend decodes together.", "models", low=1, high=1024),
    _s(
        "ERMEDRAG_HF_SHARE_PREFIX",
        "bool",
        True,
        "The hf backend computes the prompt prefix a batch's calls share once.",
        "models",
    ),
    _s(
        "ERMEDRAG_LLAMACPP_THREADS",
        "int",
        None,
        "llama.cpp threads (default: every core this process may use).",
        "models",
        low=1,
        high=4096,
    ),
    _s(
        "ERMEDRAG_LLAMACPP_CTX",
        "int",
        8192,
        "llama.cpp context in tokens, shared by a batch.",
        "models",
        low=256,
        high=2**20,
    ),
    _s("ERMEDRAG_LLAMACPP_MAX_BATCH", "int", 8, "Sequences llama.cpp decodes together.", "models", low=1, high=256),
    # model servers
    _s(
        "OPENAI_BASE_URL",
        "str",
        "",
        "OpenAI-compatible server of openai: models, e.g. http://127.0.0.1:8000/v1.",
        "servers",
    ),
    _s(
        "OPENAI_API_KEY",
        "str",
        "EMPTY",
        "Key sent to the server of openai: models (local servers take any).",
        "servers",
    ),
    _s(
        "ERMEDRAG_OPENAI_VISION",
        "bool",
        True,
        "openai: models see images; false declares the server's model "
        "text-only (images are then refused here, not by the server).",
        "servers",
    ),
    _s(
        "ERMEDRAG_SERVER_TOKENIZER",
        "str",
        "",
        "Tokenizer (folder, hub id, GGUF file or offline:NAME) with the served model's chat template: lets "
        "servers other than vLLM continue an assistant turn. Empty = the served model's name, if found here.",
        "servers",
    ),
    _s(
        "ERMEDRAG_REQUEST_TIMEOUT_S",
        "float",
        60.0,
        "Deadline of one attempt at a model-server call, from connecting to the last byte.",
        "servers",
        low=0.0,
    ),
    _s(
        "ERMEDRAG_CONNECT_TIMEOUT_S",
        "float",
        5.0,
        "Seconds to open a connection to a model server.",
        "servers",
        low=0.0,
    ),
    _s(
        "ERMEDRAG_MAX_RETRIES",
        "int",
        2,
        "Retries of a failed model-server call (refused, timed out, dropped, 408/409/429/5xx).",
        "servers",
        low=0,
        high=10,
    ),
    _s(
        "ERMEDRAG_RETRY_BACKOFF_S",
        "float",
        0.5,
        "Wait before the first retry; it doubles per retry, up to 8 s.",
        "servers",
        low=0.0,
    ),
    # retrieval
    _s(
        "ERMEDRAG_INDEX_DIR",
        "path",
        "",
        "Corpus index built by `ermedrag index`; empty = the starter knowledge base.",
        "retrieval",
    ),
    _s(
        "ERMEDRAG_CHROMA_URL",
        "str",
        "",
        "A Chroma server (http://host:port) instead of the embedded store.",
        "retrieval",
    ),
    _s(
        "ERMEDRAG_COARSE_K",
        "int",
        8,
        "Chunks the coarse stage keeps (BM25 and dense fused, one round of "
        "pseudo-relevance feedback); at least one per snippet.",
        "retrieval",
        low=0,
    ),
    _s("ERMEDRAG_SNIPPETS_K", "int", 4, "Snippets the fine stage keeps: one extractor call each.", "retrieval", low=0),
    _s("ERMEDRAG_SEARCH_K", "int", 5, "Snippets one Med-R³ search returns (the paper: the top 5).", "retrieval", low=0),
    _s(
        "ERMEDRAG_RERANKER",
        "str",
        "",
        "Cross-encoder (id or folder, e.g. ncbi/MedCPT-Cross-Encoder) that re-scores the coarse chunks; empty = off.",
        "retrieval",
    ),
    # Med-R³
    _s(
        "ERMEDRAG_MAX_SEARCHES",
        "int",
        reasoner.MAX_SEARCHES,
        "Med-R³: searches allowed per question (the paper: 4).",
        "med_r3",
        low=0,
    ),
    _s(
        "ERMEDRAG_STEP_MAX_NEW_TOKENS",
        "int",
        reasoner.STEP_MAX_NEW_TOKENS,
        "Med-R³: budget of one reasoning step (until a search closes or the answer ends).",
        "med_r3",
        low=0,
    ),
    _s(
        "ERMEDRAG_MAX_TOTAL_TOKENS",
        "int",
        reasoner.MAX_TOTAL_TOKENS,
        "Med-R³: the model's own tokens over all steps of a question; then it must answer with what it has.",
        "med_r3",
        low=0,
    ),
    # MMedAgent-RL
    _s(
        "ERMEDRAG_SPECIALTIES",
        "str",
        ", ".join(triage.SPECIALTIES),
        "MMedAgent: the specialties the triage doctor chooses from, comma-separated (the paper's seven by default).",
        "mmedagent",
    ),
    _s(
        "ERMEDRAG_TRIAGE_MODE",
        "str",
        "model",
        "MMedAgent: model (the triage model chooses), oracle (the input's gold_specialty) or fixed:NAME (always NAME).",
        "mmedagent",
    ),
    _s(
        "ERMEDRAG_DEFAULT_SPECIALTY",
        "str",
        "",
        "MMedAgent: the specialty used when triage names none of the list (recorded as a fallback); empty = the first.",
        "mmedagent",
    ),
    _s(
        "ERMEDRAG_N_SPECIALISTS",
        "int",
        3,
        "MMedAgent: specialists consulted per question (the paper: three; at temperature 0 they agree).",
        "mmedagent",
        low=1,
        high=specialist.MAX_SPECIALISTS,
    ),
    _s(
        "ERMEDRAG_ATTENDING_SAMPLES",
        "int",
        1,
        "MMedAgent: attending calls per question; above 1 the answer is "
        "their majority vote (ties: the answer given first).",
        "mmedagent",
        low=1,
        high=attending.MAX_ATTENDING_SAMPLES,
    ),
    _s(
        "ERMEDRAG_TRIAGE_MODEL",
        "str",
        "",
        "MMedAgent: the triage doctor's model; empty = the respondent's.",
        "mmedagent",
    ),
    _s(
        "ERMEDRAG_SPECIALIST_MODEL",
        "str",
        "",
        "MMedAgent: the specialists' model (the paper: a frozen strong model); empty = the respondent's.",
        "mmedagent",
    ),
    _s(
        "ERMEDRAG_ATTENDING_MODEL",
        "str",
        "",
        "MMedAgent: the attending physician's model; empty = the respondent's.",
        "mmedagent",
    ),
    _s(
        "ERMEDRAG_SPECIALIST_RETRIEVAL",
        "bool",
        False,
        "MMedAgent: retrieve the question's evidence once (index_dir, "
        "snippets_k, coarse_k, reranker) and show it to every specialist.",
        "mmedagent",
    ),
    _s(
        "ERMEDRAG_TRIAGE_MAX_NEW_TOKENS",
        "int",
        triage.TRIAGE_MAX_NEW_TOKENS,
        "MMedAgent: budget of the triage call.",
        "mmedagent",
        low=0,
    ),
    _s(
        "ERMEDRAG_SPECIALIST_MAX_NEW_TOKENS",
        "int",
        specialist.SPECIALIST_MAX_NEW_TOKENS,
        "MMedAgent: budget of one specialist call.",
        "mmedagent",
        low=0,
    ),
    _s(
        "ERMEDRAG_ATTENDING_MAX_NEW_TOKENS",
        "int",
        attending.ATTENDING_MAX_NEW_TOKENS,
        "MMedAgent: budget of one attending call.",
        "mmedagent",
        low=0,
    ),
    # data, records, caches
    _s(
        "ERMEDRAG_HOME",
        "path",
        "~/.cache/ermedrag",
        "Cache root: converted models, the starter index, images, default trace and checkpoint stores.",
        "files",
    ),
    _s(
        "ERMEDRAG_TRACE_DB", "path", "", "SQLite file of recorded runs; empty = <ERMEDRAG_HOME>/traces.sqlite.", "files"
    ),
    _s(
        "ERMEDRAG_CHECKPOINT_DB",
        "str",
        "",
        "Checkpoints of durable runs (a file, or a postgresql:// URL); empty = <ERMEDRAG_HOME>/checkpoints.sqlite.",
        "files",
    ),
    _s(
        "ERMEDRAG_SHARED_DATA",
        "path",
        "",
        "Shared data root (benchmarks/, corpora/, retrieval/) for evals, exports "
        "and tests; empty = download from the hub.",
        "files",
    ),
    _s("ERMEDRAG_GPQA_PASSWORD", "str", "deserted-untie-orchid", "Password of the shared GPQA zip.", "files"),
    _s(
        "ERMEDRAG_IMAGE_ROOTS",
        "str",
        "",
        "Folders input image paths may come from (os.pathsep-separated); empty = the working and temporary folders.",
        "files",
    ),
    _s(
        "ERMEDRAG_INDEX_PAUSE",
        "str",
        "",
        "Test hook: `point:seconds,...` pauses an index build at named points.",
        "files",
    ),
)
BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


def parse_bool(value: str | bool) -> bool:
    """'1/true/yes/on' or '0/false/no/off' (any case) as a bool, else a ValueError."""
    if isinstance(value, bool):
        return value
    lowered = str(value).strip().lower()
    if lowered in TRUE_WORDS:
        return True
    if lowered in FALSE_WORDS:
        return False
    raise ValueError(f"{value!r} is not a boolean (use true or false)")


def read(name: str) -> Any:
    """The typed value of the setting `name` now: the variable's, its fallback's, or the default."""
    setting = BY_NAME[name]
    raw = os.environ.get(name)
    if (raw is None or not raw.strip()) and setting.fallback:
        return read(setting.fallback)
    if raw is None or not raw.strip():
        return _expand(setting, default(name))
    try:
        return _expand(setting, _parse(setting, raw.strip()))
    except ValueError as err:
        raise ValueError(f"environment variable {name}={raw!r}: {err}") from None


def cache_home() -> Path:
    """Where ermedrag keeps its files (ERMEDRAG_HOME): converted models, the starter index, images, stores."""
    return Path(read("ERMEDRAG_HOME"))


def default(name: str) -> Any:
    value = BY_NAME[name].default
    return value() if callable(value) else value


def _parse(setting: Setting, raw: str) -> Any:
    if setting.kind == "bool":
        return parse_bool(raw)
    if setting.kind in ("int", "float"):
        try:
            value = int(raw) if setting.kind == "int" else float(raw)
        except ValueError:
            raise ValueError(f"expected a{'n integer' if setting.kind == 'int' else ' number'}") from None
        if (
            not math.isfinite(value)
            or (setting.low is not None and value < setting.low)
            or (setting.high is not None and value > setting.high)
        ):
            raise ValueError(f"expected {_range(setting)}")
        return value
    if setting.choices and raw.lower() not in setting.choices:
        raise ValueError(f"expected one of {', '.join(setting.choices)}")
    return raw.lower() if setting.choices else raw


def _expand(setting: Setting, value: Any) -> Any:
    return str(Path(value).expanduser()) if setting.kind == "path" and value else value


def _range(setting: Setting) -> str:
    if setting.low is not None and setting.high is not None:
        return f"a number from {setting.low:g} to {setting.high:g}"
    return f"a number of at least {setting.low:g}" if setting.low is not None else f"at most {setting.high:g}"


def description(name: str) -> str:
    """The help of `name` as Studio shows it on a context field: the help, then where its default comes from."""
    setting = BY_NAME[name]
    return f"{setting.help} Env {name}" + (f" (else {setting.fallback})." if setting.fallback else ".")


def context_field(name: str) -> Field:
    """A context dataclass field whose default is the setting `name`, read when the context is built."""
    return field(default_factory=lambda: read(name), metadata={"description": description(name), "env": name})


def settings_table() -> str:
    """The README's table of settings (Markdown), one row per variable."""
    rows = ["| variable | default | what it sets |", "|---|---|---|"]
    for s in SETTINGS:
        shown = f"`{s.default}`" if s.default not in (None, "") else ("= " + s.fallback if s.fallback else "—")
        shown = s.shown or shown
        if isinstance(s.default, bool):
            shown = f"`{str(s.default).lower()}`"
        rows.append(f"| `{s.name}` | {shown} | {s.help} |")
    return "\n".join(rows)


TABLE_BEGIN, TABLE_END = "<!-- settings-table:begin -->", "<!-- settings-table:end -->"


def with_table(readme: str) -> str:
    """`readme` with the text between its settings-table markers replaced by `settings_table()`."""
    head, begin, rest = readme.partition(TABLE_BEGIN)
    _, end, tail = rest.partition(TABLE_END)
    if not begin or not end:
        raise ValueError(f"the README has no {TABLE_BEGIN} … {TABLE_END} block")
    return f"{head}{begin}\n{settings_table()}\n{end}{tail}"


if __name__ == "__main__":  # python -m ermedrag.tools.settings README.md: rewrite its settings table
    import sys

    for path in sys.argv[1:]:
        Path(path).write_text(with_table(Path(path).read_text(encoding="utf-8")), encoding="utf-8")
