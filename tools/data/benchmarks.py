"""The eight medical benchmarks, normalised to one `Question` type.

Two sources for each: the shared JSONL schema (`{"id", "question", "options", "answer", "source", ...}`,
one file per benchmark in a data folder), and the upstream dataset a user with internet would load
(Hugging Face hub ids, or MIRAGE's file for BioASQ). Options are always letter-keyed in letter order;
upstream formats whose options are unlettered (GPQA) are shuffled with a fixed seed.
"""

from __future__ import annotations

import json
import os
import random
import string
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from ermedrag.agents.respondent import is_blank
from ermedrag.tools import settings


@dataclass(frozen=True)
class Question:
    id: str
    question: str
    options: dict[str, str]
    answer: str
    benchmark: str
    subject: str = ""
    contexts: tuple[str, ...] = ()  # PubMedQA's abstract (without its conclusion), when the benchmark has one
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def conclusion(self) -> str | None:
        """The benchmark's own conclusion for the question (PubMedQA's `long_answer`), on one line; None without."""
        text = self.meta.get("long_answer") if isinstance(self.meta, dict) else None
        if not isinstance(text, str):
            return None
        return " ".join(text.split()) or None


@dataclass(frozen=True)
class BadRow:
    """A row that cannot be scored; reported with its id, never silently counted."""

    benchmark: str
    id: str
    problem: str


@dataclass(frozen=True)
class Benchmark:
    name: str
    local_files: tuple[str, ...]  # file names in the shared data folder
    upstream: Callable[[], Iterable[dict[str, Any]]]  # rows already in the shared schema


class BenchmarkUnavailable(FileNotFoundError):
    """An upstream benchmark could not be downloaded (no network, HF_HUB_OFFLINE, a gated dataset). A
    FileNotFoundError, so the CLI prints it as one line: the dataset, the cause, and the local alternatives."""


def _download_errors() -> tuple[type[BaseException], ...]:
    """What a failed download raises: OSError covers datasets' ConnectionError and DatasetNotFoundError, hub
    HTTP errors and urllib's URLError; httpx's own errors are not OSErrors."""
    try:
        import httpx
    except ImportError:  # pragma: no cover - a dependency of huggingface_hub
        return (OSError,)
    return (OSError, httpx.HTTPError)


def _unavailable(benchmark: str, source: str, err: BaseException) -> BenchmarkUnavailable:
    cause = " ".join(f"{type(err).__name__}: {err}".split())[:300]
    files = ", ".join(f"benchmarks/{f}" for f in BENCHMARKS[benchmark].local_files)
    return BenchmarkUnavailable(
        f"cannot download benchmark {benchmark!r} from {source} ({cause}); without internet, pass --data DIR "
        f"(a data folder holding {files}) or set ERMEDRAG_SHARED_DATA to one"
    )


# The Hugging Face hub dataset of each benchmark but BioASQ (MIRAGE_URL).
HUB_DATASETS = {
    "medqa": "GBaker/MedQA-USMLE-4-options",
    "medmcqa": "openlifescienceai/medmcqa",
    "pubmedqa": "qiaojin/PubMedQA",
    "mmlu_med": "cais/mmlu",
    "mmlu_pro": "TIGER-Lab/MMLU-Pro",
    "gpqa": "Idavidrein/gpqa",
    "medxpertqa": "TsinghuaC3I/MedXpertQA",
}


def _hub(name: str, config: str | None, split: str) -> Iterator[dict[str, Any]]:
    """Rows of hub dataset `name` (a value of HUB_DATASETS); a failed download is one `BenchmarkUnavailable`
    naming its benchmark, not a traceback."""
    from datasets import load_dataset

    try:
        rows = load_dataset(name, config, split=split)
    except _download_errors() as err:
        benchmark = next(b for b, hub in HUB_DATASETS.items() if hub == name)
        raise _unavailable(benchmark, f"the Hugging Face hub dataset {name}", err) from err
    yield from rows


def _letters(n: int) -> list[str]:
    return list(string.ascii_uppercase[:n])


def _medqa_upstream() -> Iterator[dict[str, Any]]:
    for i, row in enumerate(_hub(HUB_DATASETS["medqa"], None, "test")):
        yield {
            "id": f"medqa-test-{i:04d}",
            "question": row["question"],
            "options": row["options"],
            "answer": row["answer_idx"],
            "meta": row.get("meta_info", ""),
        }


def _medmcqa_upstream() -> Iterator[dict[str, Any]]:
    for row in _hub(HUB_DATASETS["medmcqa"], None, "validation"):
        yield {
            "id": f"medmcqa-{row['id']}",
            "question": row["question"],
            "options": dict(zip("ABCD", (row["opa"], row["opb"], row["opc"], row["opd"]))),
            "answer": "ABCD"[int(row["cop"])],
            "subject": row.get("subject_name", ""),
        }


def _pubmedqa_upstream() -> Iterator[dict[str, Any]]:
    labels = {"yes": "A", "no": "B", "maybe": "C"}
    for row in _hub(HUB_DATASETS["pubmedqa"], "pqa_labeled", "train"):
        yield {
            "id": f"pubmedqa-{row['pubid']}",
            "question": row["question"],
            "options": {"A": "yes", "B": "no", "C": "maybe"},
            "answer": labels.get(row["final_decision"], ""),
            "contexts": list(row["context"]["contexts"]),
        }


MMLU_MED_SUBJECTS = (
    "anatomy",
    "clinical_knowledge",
    "college_biology",
    "college_medicine",
    "medical_genetics",
    "professional_medicine",
)


def _mmlu_med_upstream() -> Iterator[dict[str, Any]]:
    for subject in MMLU_MED_SUBJECTS:
        for i, row in enumerate(_hub(HUB_DATASETS["mmlu_med"], subject, "test")):
            yield {
                "id": f"mmlu-{subject}-{i:03d}",
                "question": row["question"],
                "options": dict(zip(_letters(len(row["choices"])), row["choices"])),
                "answer": "ABCD"[int(row["answer"])],
                "subject": subject,
            }


def _mmlu_pro_upstream() -> Iterator[dict[str, Any]]:
    for row in _hub(HUB_DATASETS["mmlu_pro"], None, "test"):
        if row["category"] in ("health", "biology"):
            yield {
                "id": f"mmlupro-{row['question_id']}",
                "question": row["question"],
                "options": dict(zip(_letters(len(row["options"])), row["options"])),
                "answer": row["answer"],
                "subject": row["category"],
            }


def _gpqa_upstream() -> Iterator[dict[str, Any]]:
    for row in _hub(HUB_DATASETS["gpqa"], "gpqa_main", "train"):
        if row.get("High-level domain") == "Biology":
            yield gpqa_row(row)


def gpqa_row(row: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """GPQA's correct + three incorrect answers as options A-D, shuffled with a per-question fixed seed."""
    choices = [row["Correct Answer"], row["Incorrect Answer 1"], row["Incorrect Answer 2"], row["Incorrect Answer 3"]]
    order = list(range(4))
    random.Random(f"{seed}:{row['Record ID']}").shuffle(order)
    options = {letter: choices[i].strip() for letter, i in zip("ABCD", order)}
    return {
        "id": f"gpqa-{row['Record ID']}",
        "question": row["Question"],
        "options": options,
        "answer": "ABCD"[order.index(0)],
        "subject": row.get("Subdomain", ""),
    }


def _medxpertqa_upstream() -> Iterator[dict[str, Any]]:
    for row in _hub(HUB_DATASETS["medxpertqa"], "Text", "test"):
        yield {
            "id": row["id"],
            "question": row["question"],
            "options": row["options"],
            "answer": row["label"],
            "subject": row.get("medical_task", ""),
        }


MIRAGE_URL = "https://raw.githubusercontent.com/Teddy-XiongGZ/MIRAGE/main/benchmark.json"


def _bioasq_upstream() -> Iterator[dict[str, Any]]:
    import urllib.request

    try:
        with urllib.request.urlopen(MIRAGE_URL, timeout=60) as response:
            benchmark_json = json.load(response)
    except OSError as err:  # URLError, a timeout, a connection reset
        raise _unavailable("bioasq", MIRAGE_URL, err) from err
    yield from mirage_rows(benchmark_json, "bioasq")


def mirage_rows(benchmark_json: dict[str, Any], name: str) -> Iterator[dict[str, Any]]:
    """Rows of one MIRAGE benchmark (`benchmark.json` maps name → id → {question, options, answer})."""
    for qid, row in benchmark_json[name].items():
        yield {"id": f"{name}-{qid}", "question": row["question"], "options": row["options"], "answer": row["answer"]}


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in [
        Benchmark("medqa", ("medqa_us_test.jsonl",), _medqa_upstream),
        Benchmark("medmcqa", ("medmcqa_dev.jsonl",), _medmcqa_upstream),
        Benchmark("pubmedqa", ("pubmedqa_test.jsonl",), _pubmedqa_upstream),
        Benchmark("mmlu_med", ("mmlu_med_test.jsonl",), _mmlu_med_upstream),
        Benchmark("mmlu_pro", ("mmlu_pro_health.jsonl", "mmlu_pro_biology.jsonl"), _mmlu_pro_upstream),
        Benchmark("gpqa", ("gpqa_biology.zip",), _gpqa_upstream),
        Benchmark("medxpertqa", ("medxpertqa_text_test.jsonl",), _medxpertqa_upstream),
        Benchmark("bioasq", ("bioasq_yesno.jsonl",), _bioasq_upstream),
    ]
}


DATA_FOLDER_HINT = "the data root holding benchmarks/ or that benchmarks folder itself"


def benchmarks_folder(path: str | os.PathLike[str], source: str = "--data") -> Path:
    """The folder of benchmark files that `path` names: a data root (it holds `benchmarks/`) or the benchmarks
    folder itself. `source` names where the path came from, for the error when it is no folder."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise FileNotFoundError(f"{source} {folder} {what}; expected {DATA_FOLDER_HINT}")
    return folder / "benchmarks" if (folder / "benchmarks").is_dir() else folder


def default_data_dir() -> Path | None:
    """The benchmarks folder of ERMEDRAG_SHARED_DATA (either form, as `--data`), or None when it is not set."""
    env = settings.read("ERMEDRAG_SHARED_DATA")
    return benchmarks_folder(env, "ERMEDRAG_SHARED_DATA") if env else None


def load_benchmark(
    name: str,
    data_dir: str | os.PathLike[str] | None = None,
    *,
    limit: int | None = None,
    seed: int = 0,
    bad_rows: list[BadRow] | None = None,
) -> list[Question]:
    """Questions of one benchmark, from `data_dir` (shared JSONL files: the data root holding `benchmarks/`, or
    the benchmarks folder) or, without it, ERMEDRAG_SHARED_DATA, or, without either, from upstream.

    `limit` takes a seeded random sample (the same for the same seed). Rows that cannot be scored are
    appended to `bad_rows` (when given) with their id and the problem, and left out.
    """
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}")
    bench = BENCHMARKS[name]
    data_dir = benchmarks_folder(data_dir) if data_dir else default_data_dir()
    rows = _local_rows(bench, data_dir) if data_dir else bench.upstream()
    return _select([normalise(row, name) for row in rows], limit, seed, bad_rows)


def load_questions_file(
    path: str | os.PathLike[str], *, limit: int | None = None, seed: int = 0, bad_rows: list[BadRow] | None = None
) -> list[Question]:
    """Questions from any JSONL file in the shared schema (the benchmark is named after the file)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such questions file: {path}")
    name = path.name.removesuffix(".jsonl")
    return _select([normalise(row, name) for row in _jsonl_rows(path)], limit, seed, bad_rows)


def _select(
    parsed: list[Question | BadRow], limit: int | None, seed: int, bad_rows: list[BadRow] | None
) -> list[Question]:
    questions = [q for q in parsed if isinstance(q, Question)]
    if bad_rows is not None:
        bad_rows.extend(q for q in parsed if isinstance(q, BadRow))
    if limit is not None and limit < len(questions):
        questions = sorted(random.Random(seed).sample(questions, limit), key=lambda q: q.id)
    return questions


def _local_rows(bench: Benchmark, data_dir: Path) -> Iterator[dict[str, Any]]:
    for file_name in bench.local_files:
        path = data_dir / file_name
        if not path.exists():
            raise FileNotFoundError(
                f"{bench.name}: no {file_name} in {data_dir} (--data and ERMEDRAG_SHARED_DATA take {DATA_FOLDER_HINT})"
            )
        if path.suffix == ".zip":
            yield from _zip_rows(path)
        else:
            yield from _jsonl_rows(path)


def _jsonl_rows(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    yield {"id": f"{path.name}:{line_no}", "_problem": "not valid JSON"}
                    continue
                if isinstance(row, dict):
                    yield row
                else:  # e.g. a JSON array: reported as a bad row with its line, never a crash
                    yield {"id": f"{path.name}:{line_no}", "_problem": f"{_json_kind(row)} is not a JSON object"}


def _json_kind(value: Any) -> str:
    kinds = {
        list: "a JSON array",
        str: "a JSON string",
        bool: "a JSON boolean",
        int: "a JSON number",
        float: "a JSON number",
        type(None): "JSON null",
    }
    return kinds.get(type(value), type(value).__name__)


def _zip_rows(path: Path) -> Iterator[dict[str, Any]]:
    """A password zip (GPQA asks that its questions never sit in plain text): extracted to a temp dir only."""
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(path) as archive:
        archive.extractall(tmp, pwd=settings.read("ERMEDRAG_GPQA_PASSWORD").encode())
        for inner in sorted(Path(tmp).rglob("*.jsonl")):
            yield from list(_jsonl_rows(inner))


def normalise(row: dict[str, Any], benchmark: str) -> Question | BadRow:
    if not isinstance(row, dict):  # upstream rows are untrusted too
        return BadRow(benchmark, "?", f"{_json_kind(row)} is not a JSON object")
    qid = str(row.get("id", "?"))
    if "_problem" in row:
        return BadRow(benchmark, qid, row["_problem"])
    question, options, answer = row.get("question"), row.get("options"), row.get("answer")
    if not isinstance(question, str) or not question.strip():
        return BadRow(benchmark, qid, "no question text")
    if not isinstance(options, dict) or len(options) < 2:
        return BadRow(benchmark, qid, "no options (at least two needed)")
    keys = [str(k).strip().upper() for k in options]
    # The graphs' canonical option keys (graphs.state.validate_question): one letter A-Z, case-insensitive.
    if any(len(k) != 1 or k not in string.ascii_uppercase for k in keys) or len(set(keys)) != len(keys):
        return BadRow(
            benchmark, qid, f"option keys {list(options)[:8]} must be distinct letters A-Z (case-insensitive)"
        )
    options = {str(k).strip().upper(): str(v) for k, v in sorted(options.items(), key=lambda kv: str(kv[0]))}
    blank = next((k for k, v in options.items() if is_blank(v)), None)
    if blank is not None:  # the graphs refuse it too (graphs.state.validate_question): never scored
        return BadRow(benchmark, qid, f"option {blank!r}: the option's text is empty (or only punctuation)")
    if str(answer).strip().upper() not in options:
        return BadRow(benchmark, qid, f"answer {answer!r} is not among the options {list(options)}")
    contexts = row.get("contexts") or ()
    meta = {k: v for k, v in row.items() if k not in ("id", "question", "options", "answer", "contexts", "subject")}
    return Question(
        id=qid,
        question=question.strip(),
        options=options,
        answer=str(answer).strip().upper(),
        benchmark=benchmark,
        subject=str(row.get("subject", "") or ""),
        contexts=tuple(str(c) for c in contexts),
        meta=meta,
    )
