"""Corpora and indexes: hostile files must be refused naming the file (or read right when told their encoding),
big documents indexed whole, duplicates counted, and an `ermedrag index` SIGKILLed at any point must leave an index
that opens in its last committed state (or repairs itself to it), with BM25, Chroma and the manifest agreeing;
a rerun then completes it."""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from benches.reliability.harness import (
    REPO,
    Verdict,
    Workspace,
    cli_in_process,
    cli_subprocess,
    crash,
    data_lost,
    judge_call,
    judge_cli,
    kill_group,
    must_refuse,
    ok,
    one_line,
    register,
    silent_wrong,
    wait_for,
)

CHILD_TIMEOUT_S = 300  # an `ermedrag index` child loads the encoder: ~10 s, more on a loaded machine
TOPICS = [
    "metformin lowers hepatic glucose output in type 2 diabetes",
    "intramuscular epinephrine is the first treatment of anaphylaxis",
    "amoxicillin treats community acquired pneumonia in adults",
    "warfarin therapy needs regular INR monitoring",
    "salbutamol relieves acute bronchospasm in asthma",
    "levothyroxine replaces thyroid hormone in hypothyroidism",
]


def documents(prefix: str, n: int) -> list[dict[str, Any]]:
    return [
        {
            "id": f"{prefix}-{i}",
            "title": f"{prefix} note {i}",
            "text": f"Note {i} of {prefix}: {TOPICS[i % len(TOPICS)]}. It was reviewed in study {prefix}{i}. "
            f"Doses depend on kidney function and age.",
        }
        for i in range(n)
    ]


def write_jsonl(path: Path, records: Iterable[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def chunk_count(*paths: Path) -> int:
    """Chunks a clean build of these files commits (`chunk_documents` with the CLI's default chunking)."""
    from ermedrag.tools.retrieval.corpus import chunk_documents, read_documents

    return len({c.id for c in chunk_documents(read_documents(list(paths)))})


def corpus_files(workspace: Workspace) -> dict[str, Path]:
    def build() -> dict[str, Path]:
        folder = workspace.path("kill/corpus")
        folder.mkdir(parents=True, exist_ok=True)
        return {
            name: write_jsonl(folder / f"{name}.jsonl", documents(name, n))
            for name, n in (("base", 8), ("extra", 12), ("other", 6))
        }

    return workspace.fixture("kill_corpus", build)


def index_env(workspace: Workspace, **extra: str) -> dict[str, str]:
    return workspace.env(**extra)


def template_index(workspace: Workspace) -> Path:
    """The base corpus indexed by `ermedrag index` (a real process), once; each kill case works on a copy."""

    def build() -> Path:
        directory = workspace.path("kill/template")
        result = cli_subprocess(
            ["index", str(corpus_files(workspace)["base"]), "--index-dir", str(directory)],
            index_env(workspace),
            CHILD_TIMEOUT_S,
        )
        if result.rc != 0:
            raise RuntimeError(f"bench setup: building the template index failed: {result.stderr[-500:]}")
        return directory

    return workspace.fixture("kill_template", build)


def fresh_copy(workspace: Workspace, name: str) -> Path:
    target = workspace.root / "kill" / name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(template_index(workspace), target)
    return target


def start_index(workspace: Workspace, corpus: Path, directory: Path, log: Path, **env: str) -> subprocess.Popen:
    handle = log.open("w")
    return subprocess.Popen(
        [sys.executable, "-m", "ermedrag", "index", str(corpus), "--index-dir", str(directory)],
        cwd=REPO,
        env=index_env(workspace, **env),
        stdout=handle,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def index_state(workspace: Workspace, directory: Path) -> dict[str, Any]:
    """`index_check` in a fresh process (see its docstring)."""
    result = subprocess.run(
        [sys.executable, "-m", "benches.reliability.index_check", str(directory)],
        cwd=REPO,
        env=index_env(workspace),
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        return {"opened": False, "error": f"index_check exit {result.returncode}: {result.stderr[-400:]}"}
    return json.loads(lines[-1])


def consistency_problem(state: dict[str, Any], allowed: set[int]) -> str | None:
    if not state.get("opened"):
        return f"the index does not open: {one_line(state.get('error'), 300)}"
    counts = (state["manifest_chunks"], state["bm25_ids"], state["chroma_count"])
    if len(set(counts)) != 1 or not state["same_ids"]:
        return f"manifest / BM25 / Chroma disagree: {counts}, same ids {state['same_ids']}"
    if counts[0] not in allowed:
        return f"{counts[0]} chunks, expected one of {sorted(allowed)}"
    return None


def rerun_and_check(workspace: Workspace, corpus: Path, directory: Path, total: int, before: str) -> Verdict:
    result = cli_subprocess(
        ["index", str(corpus), "--index-dir", str(directory)], index_env(workspace), CHILD_TIMEOUT_S
    )
    if result.rc != 0:
        return judge_cli(result, ("index",), refusal_expected=False)
    problem = consistency_problem(index_state(workspace, directory), {total})
    if problem:
        return data_lost(f"after the rerun: {problem}")
    return ok(f"{before}; the rerun completed it: {total} chunks, manifest = BM25 = Chroma")


def kill_at_point(name: str, point: str, committed: bool, quick: bool = False) -> None:
    @register(
        name,
        "indexing",
        f"ermedrag index SIGKILLed at '{point}': opens with the "
        f"{'new' if committed else 'old'} commit, BM25 = Chroma = manifest; a rerun completes it",
        quick=quick,
        timeout_s=CHILD_TIMEOUT_S * 3,
    )
    def run(workspace: Workspace) -> Verdict:
        files = corpus_files(workspace)
        base, full = chunk_count(files["base"]), chunk_count(files["base"], files["extra"])
        directory = fresh_copy(workspace, name)
        log = workspace.path(f"kill/{name}.log")
        proc = start_index(workspace, files["extra"], directory, log, ERMEDRAG_INDEX_PAUSE=f"{point}:120")
        try:
            reached = wait_for(
                lambda: f"ERMEDRAG_INDEX_PAUSE {point}" in log.read_text(errors="replace") or proc.poll() is not None,
                CHILD_TIMEOUT_S,
            )
        finally:
            kill_group(proc)
        if not reached or f"ERMEDRAG_INDEX_PAUSE {point}" not in log.read_text(errors="replace"):
            return crash(f"bench setup: the build never reached '{point}': {one_line(log.read_text()[-300:])}")
        expected = full if committed else base
        problem = consistency_problem(index_state(workspace, directory), {expected})
        if problem:
            return data_lost(f"after the kill at {point}: {problem}")
        return rerun_and_check(
            workspace, files["extra"], directory, full, f"killed at {point}: opened with {expected} chunks"
        )


kill_at_point("index_kill_after_vectors_added", "vectors_added", committed=False)
kill_at_point("index_kill_after_bm25_staged", "bm25_staged", committed=False)
kill_at_point("index_kill_after_manifest_staged", "manifest_staged", committed=False)
kill_at_point("index_kill_after_commit", "committed", committed=True)


def kill_at_random(name: str, seed: int, after: str, window_s: float) -> None:
    @register(
        name,
        "indexing",
        f"ermedrag index SIGKILLed at a random moment (seed {seed}) within {window_s:g} s "
        f"after it printed {after!r}: opens with the old or the new commit, BM25 = Chroma = manifest; a rerun "
        "completes it",
        timeout_s=CHILD_TIMEOUT_S * 3,
    )
    def run(workspace: Workspace) -> Verdict:
        files = corpus_files(workspace)
        base, full = chunk_count(files["base"]), chunk_count(files["base"], files["extra"])
        directory = fresh_copy(workspace, name)
        log = workspace.path(f"kill/{name}.log")
        delay = random.Random(seed).uniform(0.0, window_s)
        # The pause hook with no pause: it only says on stderr which points the build passed before the kill.
        points = ",".join(f"{p}:0" for p in ("vectors_added", "bm25_staged", "manifest_staged", "committed"))
        proc = start_index(workspace, files["extra"], directory, log, ERMEDRAG_INDEX_PAUSE=points)
        try:
            wait_for(lambda: after in log.read_text(errors="replace") or proc.poll() is not None, CHILD_TIMEOUT_S)
            finished = wait_for(lambda: proc.poll() is not None, delay)
        finally:
            kill_group(proc)
        passed = re.findall(r"ERMEDRAG_INDEX_PAUSE (\w+)", log.read_text(errors="replace"))
        state = index_state(workspace, directory)
        problem = consistency_problem(state, {full} if "committed" in passed else {base, full})
        when = "after it finished" if finished else f"{delay:.2f} s after {after!r}, past {passed or 'no commit step'}"
        if problem:
            return data_lost(f"killed {when}: {problem}")
        return rerun_and_check(
            workspace, files["extra"], directory, full, f"killed {when}: opened with {state['manifest_chunks']} chunks"
        )


# Anywhere in the build: chunking, loading the encoder, embedding, adding, committing (the commit itself takes
# milliseconds for this corpus: the named points above are what reliably land inside it).
for _seed in (1, 2, 3):
    kill_at_random(f"index_kill_at_random_{_seed}", _seed, "read ", 20.0)


@register(
    "index_kill_during_repair",
    "indexing",
    "a build killed after adding vectors, then another build (other documents) killed while it removes the "
    "first one's uncommitted chunks: opens with the old commit, consistent; a rerun completes",
    timeout_s=CHILD_TIMEOUT_S * 4,
)
def kill_during_repair(workspace: Workspace) -> Verdict:
    files = corpus_files(workspace)
    base, full = chunk_count(files["base"]), chunk_count(files["base"], files["other"])
    directory = fresh_copy(workspace, "repair")
    for corpus, point in ((files["extra"], "vectors_added"), (files["other"], "repairing")):
        log = workspace.path(f"kill/repair-{point}.log")
        proc = start_index(workspace, corpus, directory, log, ERMEDRAG_INDEX_PAUSE=f"{point}:120")
        try:
            wait_for(
                lambda: f"ERMEDRAG_INDEX_PAUSE {point}" in log.read_text(errors="replace") or proc.poll() is not None,
                CHILD_TIMEOUT_S,
            )
        finally:
            kill_group(proc)
        if f"ERMEDRAG_INDEX_PAUSE {point}" not in log.read_text(errors="replace"):
            return crash(f"bench setup: the build never reached '{point}': {one_line(log.read_text()[-300:])}")
    problem = consistency_problem(index_state(workspace, directory), {base})
    if problem:
        return data_lost(f"after the kill during repair: {problem}")
    return rerun_and_check(workspace, files["other"], directory, full, f"killed during repair: opened with {base}")


@register(
    "index_two_builds_at_once",
    "indexing",
    "two ermedrag index processes adding different files to one index at the same time: both succeed (one "
    "waits for the other), and the index holds both, consistent",
    timeout_s=CHILD_TIMEOUT_S * 3,
)
def two_builds(workspace: Workspace) -> Verdict:
    files = corpus_files(workspace)
    full = chunk_count(files["base"], files["extra"], files["other"])
    directory = fresh_copy(workspace, "concurrent")
    procs = [
        start_index(workspace, files[name], directory, workspace.path(f"kill/concurrent-{name}.log"))
        for name in ("extra", "other")
    ]
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=CHILD_TIMEOUT_S))
        except subprocess.TimeoutExpired:
            kill_group(proc)
            codes.append(None)
    if codes != [0, 0]:
        logs = [one_line(workspace.path(f"kill/concurrent-{n}.log").read_text()[-200:]) for n in ("extra", "other")]
        return crash(f"exit codes {codes}: {logs}")
    problem = consistency_problem(index_state(workspace, directory), {full})
    return data_lost(problem) if problem else ok(f"both builds committed: {full} chunks, consistent")


# ------------------------------------------------------------------------------------------------ files


def refused_file(
    name: str, content: bytes, names: tuple[str, ...], what: str, suffix: str = ".txt", encoding: str | None = None
) -> None:
    @register(name, "indexing", f"read_documents refuses {what} with a CorpusError naming the file", quick=True)
    def run(workspace: Workspace) -> Verdict:
        from ermedrag.tools.retrieval.corpus import read_documents

        path = workspace.path(f"files/{name}{suffix}")
        path.write_bytes(content)
        return judge_call(lambda: read_documents([path], encoding=encoding), must_refuse(what), (path.name, *names))


LATIN1 = "Café au lait spots and naïve T cells: a résumé of the évidence.\n".encode("latin-1")
refused_file("file_latin1_without_encoding", LATIN1, ("latin-1", "encoding"), "a latin-1 .txt read as UTF-8")
refused_file("file_random_bytes", random.Random(0).randbytes(4096), ("binary", "UTF-8"), "4 KB of random bytes")
refused_file(
    "file_nul_bytes",
    b"Metformin lowers glucose.\x00\x00\x00 It is first-line.\n",
    ("NUL", "binary"),
    "a .txt with NUL bytes",
)
refused_file(
    "file_utf16_without_encoding",
    "Metformin is first-line.\n".encode("utf-16"),
    ("utf-16",),
    "a UTF-16 .txt read as UTF-8",
)
refused_file(
    "file_jsonl_bad_line",
    b'{"id": "a", "text": "fine"}\n{"id": "b", "text": \n',
    (":2",),
    "a JSONL file whose line 2 is not JSON",
    suffix=".jsonl",
)
refused_file(
    "file_jsonl_array_line",
    b'{"id": "a", "text": "fine"}\n[1, 2, 3]\n',
    (":2",),
    "a JSONL line that is an array",
    suffix=".jsonl",
)
refused_file(
    "file_jsonl_missing_id", b'{"text": "no id here"}\n', (":1", "id"), "a JSONL record without an id", suffix=".jsonl"
)
refused_file(
    "file_jsonl_empty_text",
    b'{"id": "a", "text": "   "}\n',
    (":1", "text"),
    "a JSONL record with empty text",
    suffix=".jsonl",
)
refused_file(
    "file_jsonl_gz_truncated",
    gzip.compress(b'{"id": "a", "text": "fine"}\n' * 200)[:-40],
    ("cannot read",),
    "a truncated .jsonl.gz",
    suffix=".jsonl.gz",
)
refused_file("file_unknown_encoding", b"plain text\n", ("klingon",), "--encoding klingon", encoding="klingon")


@register(
    "file_latin1_with_encoding",
    "indexing",
    "read_documents(encoding='latin-1') reads a latin-1 .txt exactly",
    quick=True,
)
def latin1_with_encoding(workspace: Workspace) -> Verdict:
    from ermedrag.tools.retrieval.corpus import read_documents

    path = workspace.path("files/latin1_ok.txt")
    path.write_bytes(LATIN1)

    def check(docs: list[Any]) -> Verdict:
        if len(docs) != 1 or docs[0].text != LATIN1.decode("latin-1"):
            return silent_wrong(f"read {[d.text for d in docs]!r}")
        return ok("text read exactly")

    return judge_call(lambda: read_documents([path], encoding="latin-1"), check, refusal_expected=False)


@register(
    "file_missing_path", "indexing", "read_documents on a path that does not exist: CorpusError naming it", quick=True
)
def missing_path(workspace: Workspace) -> Verdict:
    from ermedrag.tools.retrieval.corpus import read_documents

    path = workspace.root / "no" / "such-corpus.jsonl"
    return judge_call(lambda: read_documents([path]), must_refuse("a missing path"), ("such-corpus.jsonl",))


@register(
    "file_folder_without_text",
    "indexing",
    "read_documents on a folder holding only a .pdf: CorpusError naming the folder",
    quick=True,
)
def folder_without_text(workspace: Workspace) -> Verdict:
    from ermedrag.tools.retrieval.corpus import read_documents

    folder = workspace.path("files/pdf_only")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "paper.pdf").write_bytes(b"%PDF-1.4 ...")
    return judge_call(lambda: read_documents([folder]), must_refuse("a folder without text files"), ("pdf_only",))


def coverage_problem(text: str, spans: list[tuple[int, int, str]]) -> str | None:
    """None when the chunks are exact spans of `text` and, together, leave out only whitespace."""
    covered_to = 0
    for start, end, chunk in sorted(spans):
        if text[start:end] != chunk:
            return f"chunk {start}-{end} is not the document's text there"
        if start > covered_to and text[covered_to:start].strip():
            return f"characters {covered_to}-{start} are in no chunk: {text[covered_to : covered_to + 60]!r}"
        covered_to = max(covered_to, end)
    if text[covered_to:].strip():
        return f"the text after offset {covered_to} of {len(text)} is in no chunk"
    return None


def big_text(chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    sentences = [
        f"Patient {i} with {TOPICS[i % len(TOPICS)]} was seen on day {rng.randint(1, 999)}." for i in range(64)
    ]
    parts, size = [], 0
    while size < chars:
        sentence = rng.choice(sentences)
        parts.append(sentence + ("\n\n" if rng.random() < 0.05 else " "))
        size += len(parts[-1])
    return "".join(parts)[:chars]


@register(
    "document_1mb_chunked_whole",
    "indexing",
    "a 1 MB document: its chunks (chunk_documents) are exact spans that cover the whole text",
    quick=True,
    timeout_s=120,
)
def document_1mb(workspace: Workspace) -> Verdict:
    from ermedrag.tools.retrieval.corpus import Document, chunk_documents

    text = big_text(1_000_000)
    chunks = chunk_documents([Document(id="big", text=text)])
    problem = coverage_problem(text, [(c.start, c.end, c.text) for c in chunks])
    return data_lost(problem) if problem else ok(f"{len(chunks)} chunks cover all {len(text):,} characters")


def hash_vector(key: str) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    vector = np.random.default_rng(seed).standard_normal(384).astype(np.float32)
    return vector / np.linalg.norm(vector)


@register(
    "document_5mb_indexed_whole",
    "indexing",
    "a 5 MB .txt read with read_documents and indexed with build_index: the chunks in Chroma cover the whole "
    "text, BM25 = Chroma = manifest (vectors precomputed: the encoder is not what is tested)",
    timeout_s=900,
)
def document_5mb(workspace: Workspace) -> Verdict:
    from ermedrag.tools.retrieval.corpus import chunk_documents, read_documents
    from ermedrag.tools.retrieval.index import build_index

    path = workspace.path("files/five_mb.txt")
    text = big_text(5_000_000, seed=5)
    path.write_text(text, encoding="utf-8")
    docs = read_documents([path])
    if len(docs) != 1 or docs[0].text != text:
        return data_lost("read_documents did not return the whole file as one document")
    vectors = {c.id: hash_vector(c.id) for c in chunk_documents(docs)}
    directory = workspace.path("files/five_mb_index")
    try:
        build_index(docs, directory, precomputed=vectors, progress=False)
    except Exception as err:  # noqa: BLE001
        from benches.reliability.harness import judge_error

        return judge_error(err, ("five_mb", "limit"))
    state = index_state(workspace, directory)
    problem = consistency_problem(state, {len(vectors)})
    if problem:
        return data_lost(problem)
    from ermedrag.tools.retrieval.index import open_index

    index = open_index(directory)
    got = index.collection.get(include=["documents", "metadatas"])
    spans = [(int(m["start"]), int(m["end"]), d) for d, m in zip(got["documents"], got["metadatas"])]
    problem = coverage_problem(text, spans)
    return (
        data_lost(problem)
        if problem
        else ok(f"{len(spans)} chunks cover all {len(text):,} characters; manifest = BM25 = Chroma")
    )


# ------------------------------------------------------------------------------------------------ the CLI


@register(
    "cli_index_duplicate_ids",
    "indexing",
    "ermedrag index of a JSONL with a reused id (other text) and an exact repeat: both texts indexed (the reuse "
    "renamed id~2), the summary line counts 1 renamed and 1 dropped",
    quick=True,
    timeout_s=180,
)
def duplicate_ids(workspace: Workspace) -> Verdict:
    corpus = write_jsonl(
        workspace.path("files/dups.jsonl"),
        [
            {"id": "d1", "text": "Metformin is first-line in type 2 diabetes."},
            {"id": "d1", "text": "Insulin is needed in diabetic ketoacidosis."},
            {"id": "d1", "text": "Metformin is first-line in type 2 diabetes."},
            {"id": "d2", "text": "Epinephrine treats anaphylaxis."},
        ],
    )
    directory = workspace.path("files/dups_index")
    result = cli_in_process(["index", str(corpus), "--index-dir", str(directory)])

    def check(result: Any) -> Verdict:
        summary = [line for line in result.stdout.splitlines() if line.startswith("indexed")]
        if not summary or "1 reused ids renamed" not in summary[0] or "1 exact repeats dropped" not in summary[0]:
            return silent_wrong(f"the summary does not count them: {one_line(summary or result.stdout, 300)}")
        from ermedrag.tools.retrieval.index import open_index

        doc_ids = {m["doc_id"] for m in open_index(directory).collection.get(include=["metadatas"])["metadatas"]}
        if doc_ids != {"d1", "d1~2", "d2"}:
            return data_lost(f"indexed documents {sorted(doc_ids)}, expected d1, d1~2, d2")
        return ok(one_line(summary[0], 200))

    return judge_cli(result, (), check=check, refusal_expected=False)


@register(
    "cli_index_duplicate_ids_refused",
    "indexing",
    "ermedrag index --on-duplicate-id error: exit 2, one error line naming the id and both places",
    quick=True,
)
def duplicate_ids_refused(workspace: Workspace) -> Verdict:
    corpus = write_jsonl(
        workspace.path("files/dups_refused.jsonl"),
        [{"id": "d1", "text": "Metformin is first-line."}, {"id": "d1", "text": "Insulin in ketoacidosis."}],
    )
    result = cli_in_process(
        [
            "index",
            str(corpus),
            "--index-dir",
            str(workspace.path("files/dups_refused_index")),
            "--on-duplicate-id",
            "error",
        ]
    )
    return judge_cli(result, ("'d1'",))


@register(
    "cli_index_changed_chunk_size",
    "indexing",
    "ermedrag index into an existing index with another --chunk-size: exit 2 naming the settings, the index unchanged",
    quick=True,
    timeout_s=180,
)
def changed_settings(workspace: Workspace) -> Verdict:
    duplicate_ids_directory = workspace.path("files/dups_index")
    if not (duplicate_ids_directory / "manifest.json").exists():
        duplicate_ids(workspace)
    before = (duplicate_ids_directory / "manifest.json").read_text()
    corpus = write_jsonl(workspace.path("files/more.jsonl"), [{"id": "d9", "text": "Warfarin needs INR checks."}])
    result = cli_in_process(["index", str(corpus), "--index-dir", str(duplicate_ids_directory), "--chunk-size", "128"])
    verdict = judge_cli(result, ("chunk_size",))
    if verdict.outcome == "clear_error" and (duplicate_ids_directory / "manifest.json").read_text() != before:
        return data_lost("refused, but the manifest changed")
    return verdict


@register(
    "cli_index_nul_in_jsonl_text",
    "indexing",
    "ermedrag index of a JSONL whose text holds an escaped NUL (\\u0000): indexed with the text intact, or "
    "refused naming the file and line",
    quick=True,
    timeout_s=180,
)
def nul_in_jsonl(workspace: Workspace) -> Verdict:
    text = "Metformin\u0000 lowers glucose output. It is first-line."
    corpus = write_jsonl(workspace.path("files/nul.jsonl"), [{"id": "n1", "text": text}])
    directory = workspace.path("files/nul_index")
    result = cli_in_process(["index", str(corpus), "--index-dir", str(directory)])

    def check(result: Any) -> Verdict:
        from ermedrag.tools.retrieval.index import open_index

        stored = open_index(directory).collection.get(include=["documents"])["documents"]
        if stored != [text]:
            return data_lost(f"stored {stored!r}")
        return ok("indexed with the text intact")

    return judge_cli(result, ("nul.jsonl",), check=check)
