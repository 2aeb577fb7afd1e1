"""The eval runner's honesty: what keys a result (settings, prompt version, option order), option permutations
mapped back to the option text, per-question model and wait seconds, `--data` in both forms, one progress bar.

Real graphs, real SQLite traces and checkpoints, the starter index; the chat model is scripted (`reply` below is
`scripted:tests.evals.test_eval_runner`: it always picks the option whose text starts with "Right").
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ermedrag.agents import attending, extractor, reasoner, respondent, specialist, triage
from ermedrag.evals.position_bias import position_bias_summary
from ermedrag.evals.runner import RESULTS, run_eval, warm_up
from ermedrag.evals.rows import Asking, EvalConfig, askings, call_seconds, done_keys, parse_overrides, question_thread
from ermedrag.graphs.registry import GRAPHS, PROMPT_VERSIONS, load_graph
from ermedrag.tools.data.benchmarks import Question, benchmarks_folder, load_benchmark
from tests.conftest import REPO, SCRIPTED

KNOWER = "scripted:tests.evals.test_eval_runner"
RIGHT = re.compile(r"^([A-Z])\. Right", re.MULTILINE)


def reply(messages) -> str:
    """The scripted model that knows: it picks the option whose text starts with "Right", wherever it stands."""
    found = RIGHT.search(messages[-1].text)
    return f"<think>The right one.</think><answer>{found.group(1) if found else 'none'}</answer>"


def _questions_file(folder: Path, name: str = "tiny.jsonl", n: int = 3) -> Path:
    """`n` four-option questions; the right option ("Right ...") stands at A, B, C, ... in turn."""
    rows = []
    for i in range(n):
        gold = "ABCD"[i % 4]
        options = {key: (f"Right answer {i}" if key == gold else f"Wrong {key} {i}") for key in "ABCD"}
        rows.append({"id": f"q{i}", "question": f"Which option is right? ({i})", "options": options, "answer": gold})
    path = folder / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / RESULTS).read_text().splitlines()]


# ------------------------------------------------------------------------------------------- permutations


def test_first_letter_model_shows_position_bias_and_order_zero_keeps_its_key(tmp_path):
    questions = _questions_file(tmp_path)
    out = tmp_path / "out"
    kwargs = dict(trace_db=str(tmp_path / "t.sqlite"), progress=False)
    plain = run_eval(["cot"], [questions], SCRIPTED, out, **kwargs)
    assert plain == {"cot": {"todo": 3, "answered": 3, "failed": 0, "skipped_done": 0}}
    before = _rows(out)
    # Permuting later keeps what was recorded: order 0 is the same key, only orders 1-3 are asked.
    permuted = run_eval(["cot"], [questions], SCRIPTED, out, permute_options=4, **kwargs)
    assert permuted == {"cot": {"todo": 9, "answered": 9, "failed": 0, "skipped_done": 3}}
    rows = _rows(out)
    assert rows[:3] == before and {r["config_key"] for r in rows} == {before[0]["config_key"]}
    assert sorted((r["question_id"], r["order"]) for r in rows) == [(f"q{i}", o) for i in range(3) for o in range(4)]
    for row in rows:
        keys = "ABCD"
        assert row["answer_position"] == "A"  # the first letter, whatever stands there
        assert row["orders"] == (1 if row in before else 4)  # the summary takes a question's largest
        assert row["answer"] == keys[row["order"] % 4]  # ... mapped back to the option text it stood for
        assert row["gold_position"] == keys[(keys.index(row["gold"]) - row["order"]) % 4]
        assert row["correct"] == (row["gold_position"] == "A") == (row["answer"] == row["gold"])
    (summary,) = position_bias_summary(rows).values()
    assert summary["consistency"] == {"questions": 3, "consistent": 0, "rate": 0.0}
    assert summary["positions"]["chosen"] == {"A": 12, "B": 0, "C": 0, "D": 0}
    assert summary["positions"]["gold"] == {"A": 3, "B": 3, "C": 3, "D": 3}
    assert summary["positions"]["total_variation"] == pytest.approx(0.75)
    # The trace of a permuted question records what the model saw: the rotated options and their gold letter.
    from ermedrag.tools.records.traces import TraceStore

    rotated = next(r for r in rows if r["order"] == 1 and r["question_id"] == "q0")
    run = TraceStore(tmp_path / "t.sqlite").run(rotated["run_id"])
    assert run["gold"] == "D" and run["question"]["options"]["D"] == "Right answer 0"


def test_a_model_that_knows_is_consistent_and_equally_accurate_in_every_order(tmp_path):
    out = tmp_path / "out"
    run_eval(
        ["cot"],
        [_questions_file(tmp_path)],
        KNOWER,
        out,
        trace_db=str(tmp_path / "t.sqlite"),
        permute_options=3,
        progress=False,
    )
    rows = _rows(out)
    assert len(rows) == 9 and all(r["correct"] and r["answer"] == r["gold"] for r in rows)
    assert all(r["answer_position"] == r["gold_position"] for r in rows)
    (summary,) = position_bias_summary(rows).values()
    assert [(o["order"], o["n"], o["accuracy"]) for o in summary["by_order"]] == [(0, 3, 1.0), (1, 3, 1.0), (2, 3, 1.0)]
    assert summary["consistency"]["rate"] == 1.0 and summary["positions"]["total_variation"] == 0.0


def test_orders_are_bounded_by_the_options_and_a_question_without_options_is_asked_once(tmp_path):
    three = Question(id="q", question="Q?", options={"A": "x", "B": "y", "C": "z"}, answer="B", benchmark="b")
    assert [(a.order, a.sample) for a in askings(three, 2, 5)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert Asking(three, 0, 1, 3).options == {"A": "y", "B": "z", "C": "x"} and Asking(three, 0, 1, 3).shown_gold == "A"
    bare = Question(id="q", question="Q?", options={}, answer="fever", benchmark="b")
    assert [(a.order, a.orders) for a in askings(bare, 1, 4)] == [(0, 1)]
    config = EvalConfig.for_graph("cot", {"respondent_model": SCRIPTED})
    # Order 0 names its checkpoint thread and its done key as before orders existed.
    assert question_thread(tmp_path, config, three, 0) == question_thread(tmp_path, config, three, 0, 0)
    assert question_thread(tmp_path, config, three, 0, 1) != question_thread(tmp_path, config, three, 0, 0)
    (tmp_path / RESULTS).write_text(
        json.dumps({"config_key": "k", "benchmark": "b", "question_id": "q", "sample": 0}) + "\n"
    )
    assert done_keys(tmp_path / RESULTS) == {("k", "b", "q", 0, 0)}
    with pytest.raises(ValueError, match="--permute-options 0"):
        run_eval(["cot"], [_questions_file(tmp_path)], SCRIPTED, tmp_path / "out", permute_options=0)


# ------------------------------------------------------------------------------------------- keying


def test_bool_settings_parse_and_split_the_key():
    assert parse_overrides(["answer_extraction=false"], ["cot"]) == {"answer_extraction": False}
    assert parse_overrides(["answer_extraction=Yes", "temperature=0.5"], ["med_r3"]) == {
        "answer_extraction": True,
        "temperature": 0.5,
    }
    assert parse_overrides(["answer_extraction=0"], ["cot"]) == {"answer_extraction": False}
    with pytest.raises(ValueError, match="answer_extraction takes true or false"):
        parse_overrides(["answer_extraction=maybe"], ["cot"])
    base = {"respondent_model": SCRIPTED}
    on, off = (EvalConfig.for_graph("cot", {**base, "answer_extraction": flag}) for flag in (True, False))
    assert on.key() != off.key() and off.settings["answer_extraction"] is False


def test_the_prompt_version_is_part_of_the_key(monkeypatch):
    base = {"respondent_model": SCRIPTED, "extractor_model": SCRIPTED}
    before = {name: EvalConfig.for_graph(name, base) for name in GRAPHS}
    assert before["er_medrag"].record()["prompt_version"] == "extractor@1,respondent@2"
    monkeypatch.setitem(PROMPT_VERSIONS, "extractor", 2)
    after = {name: EvalConfig.for_graph(name, base) for name in GRAPHS}
    changed = {name for name in GRAPHS if after[name].key() != before[name].key()}
    assert changed == {"er_medrag"}, "only the graph that calls the extractor splits"
    monkeypatch.setitem(PROMPT_VERSIONS, "respondent", 3)
    assert all(EvalConfig.for_graph(name, base).key() != before[name].key() for name in GRAPHS)


# Each agent's rendered prompts, pinned to its prompt version. When one fails: if the change alters what a model
# is asked, bump PROMPT_VERSIONS[agent] in graphs/registry.py (results of the graphs calling it split from the
# old ones); either way set the new fingerprint here.
PINNED_PROMPTS = {
    "respondent": (2, "9e114f03ee58ba28"),
    "extractor": (1, "29162c64db382b6f"),
    "reasoner": (2, "d171d346f6ef40b7"),
    "mmedagent": (3, "9ccfa89bf76ed38e"),
}


def _rendered_prompts(agent: str) -> list[Any]:
    question, four = "Which drug first?", {"A": "Insulin", "B": "Metformin", "C": "Glipizide", "D": "Diet"}
    three = {"A": "yes", "B": "no", "C": "maybe"}
    snippet = {
        "id": "doc@0-9",
        "doc_id": "doc",
        "title": "Title",
        "source": "src",
        "text": "Metformin first.",
        "score": 1.0,
        "start": 0,
        "end": 9,
    }
    if agent == "respondent":
        conversations = [
            respondent.build_messages(question, options, respondent.render_snippets([snippet]))
            for options in (four, three, None)
        ]
        if hasattr(respondent, "extraction_messages"):
            conversations.append(respondent.extraction_messages(question, four, "so it is metformin"))
        triplets = [
            {
                "condition": "type 2 diabetes",
                "relation": "treated first with",
                "conclusion": "metformin",
                "snippet_id": "doc@0-9",
            }
        ]
        return [conversations, extractor.render_triplets(triplets)]
    if agent == "extractor":
        return [extractor.build_messages(question, snippet["text"])]
    if agent == "reasoner":
        return [
            [reasoner.build_messages(question, options, "<think>I should check.") for options in (four, None)],
            reasoner.force_answer_prompt("I think"),
            reasoner.render_documents([snippet]),
        ]
    if agent == "mmedagent":
        opinion = specialist.opinion(1, "Endocrinologist", "m", respondent.parse_answer("<answer>B</answer>", four))
        return [
            triage.triage_messages(question, four, triage.SPECIALTIES),
            specialist.specialist_messages("Endocrinologist", question, four, None),
            attending.attending_messages(question, four, [opinion]),
        ]
    raise AssertionError(f"render the prompts of the agent {agent!r} here, to pin them")


def _fingerprint(value: Any) -> str:
    def plain(item: Any) -> Any:
        if isinstance(item, (list, tuple)):
            return [plain(i) for i in item]
        return [item.type, item.text] if hasattr(item, "type") and hasattr(item, "text") else item

    return hashlib.sha256(json.dumps(plain(value), sort_keys=True).encode()).hexdigest()[:16]


@pytest.mark.parametrize("agent", sorted(PINNED_PROMPTS))
def test_prompts_are_pinned_to_their_version(agent):
    version, fingerprint = PINNED_PROMPTS[agent]
    now = _fingerprint(_rendered_prompts(agent))
    assert (PROMPT_VERSIONS[agent], now) == (version, fingerprint), (
        f"agents/{agent}.py renders other prompts than version {version} ({now}): if models are asked something "
        f"else, bump PROMPT_VERSIONS[{agent!r}] in graphs/registry.py; then pin ({PROMPT_VERSIONS[agent]}, {now!r}) "
        "in PINNED_PROMPTS"
    )
    assert {a for spec in GRAPHS.values() for a in spec.agents} == set(PROMPT_VERSIONS) == set(PINNED_PROMPTS)


# Context fields that never change an answer (where things are served, how long to wait): outside every key.
PLUMBING = {
    "base_url",
    "chroma_url",
    "trace_db",
    "request_timeout_s",
    "connect_timeout_s",
    "max_retries",
    "retry_backoff_s",
}


def _recording(schema: type, **values: Any) -> Any:
    """A context of `schema` that notes every field a graph node reads."""
    names = {f.name for f in dataclasses.fields(schema)}

    class Recording(schema):  # type: ignore[misc, valid-type]
        def __getattribute__(self, name: str) -> Any:
            if name in names:
                object.__getattribute__(self, "read").add(name)
            return object.__getattribute__(self, name)

    context = Recording(**values)
    object.__setattr__(context, "read", set())
    return context


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_every_setting_a_graph_reads_is_in_its_key(name, tmp_path):
    graph = load_graph(name)
    context = _recording(
        graph.context_schema, respondent_model=SCRIPTED, extractor_model=SCRIPTED, trace_db=str(tmp_path / "t.sqlite")
    )
    state = graph.invoke(
        {
            "question": "What is the first-line treatment for anaphylaxis?",
            "options": {"A": "Epinephrine", "B": "Antihistamine"},
        },
        context=context,
    )
    assert state["answer"]["ok"]
    unkeyed = context.read - set(GRAPHS[name].settings) - PLUMBING
    assert not unkeyed, f"{name} reads {sorted(unkeyed)}: add them to its settings in graphs/registry.py"


# ------------------------------------------------------------------------------------------- rows


def test_model_and_wait_seconds_sum_the_calls():
    events = [{"latency_s": 2.0}, {"latency_s": 5.0, "compute_s": 1.5, "queue_s": 3.0}, {"compute_s": 0.5}]
    assert call_seconds(events) == {"model_seconds": 4.0, "wait_seconds": 3.0}
    assert call_seconds([{"latency_s": 1.0}]) == {"model_seconds": 1.0, "wait_seconds": None}


def test_warm_up_builds_every_model_of_a_configuration(tmp_path):
    config = EvalConfig.for_graph("er_medrag", {"respondent_model": SCRIPTED, "extractor_model": KNOWER})
    assert sorted(warm_up(config, None, str(tmp_path / "t.sqlite"))) == [SCRIPTED, KNOWER]


# ------------------------------------------------------------------------------------------- --data


def _data_root(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    (root / "benchmarks").mkdir(parents=True)
    _questions_file(root / "benchmarks", "medqa_us_test.jsonl", n=2)
    _questions_file(root / "benchmarks", "pubmedqa_test.jsonl", n=2)
    return root


def test_data_takes_the_root_or_the_benchmarks_folder(tmp_path, monkeypatch):
    root = _data_root(tmp_path)
    assert benchmarks_folder(root) == benchmarks_folder(root / "benchmarks") == root / "benchmarks"
    ids = [q.id for q in load_benchmark("medqa", root / "benchmarks")]
    assert ids == ["q0", "q1"] and [q.id for q in load_benchmark("medqa", root)] == ids
    for form in (root, root / "benchmarks"):
        monkeypatch.setenv("ERMEDRAG_SHARED_DATA", str(form))
        assert [q.id for q in load_benchmark("pubmedqa")] == ids
    monkeypatch.setenv("ERMEDRAG_SHARED_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=r"ERMEDRAG_SHARED_DATA .*nowhere does not exist; expected the data"):
        load_benchmark("medqa")
    with pytest.raises(FileNotFoundError, match=r"--data .*medqa_us_test.jsonl is a file, not a folder"):
        load_benchmark("medqa", root / "benchmarks" / "medqa_us_test.jsonl")
    with pytest.raises(FileNotFoundError, match=rf"bioasq: no bioasq_yesno.jsonl in {root / 'benchmarks'}"):
        load_benchmark("bioasq", root)


def test_shared_data_root_and_benchmarks_folder_load_the_same(shared_data):
    assert [q.id for q in load_benchmark("pubmedqa", shared_data, limit=3)] == [
        q.id for q in load_benchmark("pubmedqa", shared_data / "benchmarks", limit=3)
    ]


# ------------------------------------------------------------------------------------------- the command


def test_eval_command_one_bar_permutations_bool_setting_and_data_root(tmp_path):
    """`ermedrag eval` end to end: --data at the data root, --permute-options, --set of a bool, and one progress
    bar for two systems on stderr."""
    root = _data_root(tmp_path)
    out = tmp_path / "out"
    env = {**os.environ, "ERMEDRAG_TRACE_DB": str(tmp_path / "t.sqlite")}
    for name in ("ERMEDRAG_SHARED_DATA", "ERMEDRAG_INDEX_DIR", "ERMEDRAG_MODEL", "OPENAI_BASE_URL"):
        env.pop(name, None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ermedrag",
            "eval",
            "--system",
            "cot,vanilla_rag",
            "--bench",
            "medqa,pubmedqa",
            "--data",
            str(root),
            "--model",
            SCRIPTED,
            "--permute-options",
            "2",
            "--set",
            "answer_extraction=false",
            "--out",
            str(out),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        timeout=300,
    )  # bytes: text mode turns \r into \n
    stderr = proc.stderr.decode(errors="replace")
    assert proc.returncode == 0, stderr[-3000:]
    rows = _rows(out)
    assert len(rows) == 2 * 4 * 2 and {r["order"] for r in rows} == {0, 1}
    assert all(r["config"]["settings"]["answer_extraction"] is False for r in rows)
    assert all(r["model_seconds"] >= 0 and "wait_seconds" in r for r in rows)
    # One bar: each refresh rewrites it in place (\r); it ends once, at 16 of 16, with the failures so far.
    bars = [line for line in stderr.split("\n") if re.search(r"\d+/16 \[", line)]
    assert len(bars) == 1, stderr[-3000:]
    final = bars[0].split("\r")[-1]
    assert final.startswith("eval cot, vanilla_rag") and "16/16" in final and "failed=0" in final, final
    assert (out / "report.md").exists()
