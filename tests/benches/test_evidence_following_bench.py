"""The evidence-following bench (benches/learning/evidence_following.py): its held-out sets on real questions, the
figures read off kept replies, and its `--smoke` run end to end (the real GRPO trainer on a tiny random model)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from datasets import load_from_disk

from ermedrag.agents.extractor import NO_EVIDENCE
from ermedrag.evals.baselines import worked_example_answer
from tests.benches.test_learning_bench import bench_module
from tests.conftest import REPO

SCRIPT = REPO / "benches" / "learning" / "evidence_following.py"


def test_heldout_sets_name_x_at_every_d_and_the_gold_in_the_gold_set(shared_data: Path) -> None:
    bench = bench_module("evidence_following")
    heldout, pool = bench.pools(shared_data, 300, 24)
    assert not {q.id for q in heldout} & {q.id for q in pool}
    assert Counter(q.answer for q in heldout) == {"A": 6, "B": 6, "C": 6, "D": 6}  # balanced positions
    rows = bench.heldout_rows(heldout, pool)
    assert Counter(r["set"] for r in rows) == {s: 24 for s in ("d0", "d2", "d4", "gold_evidence", "no_evidence")}
    by_question: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_question.setdefault(row["run_id"], {})[row["set"]] = row
    xs = []
    for sets in by_question.values():
        x = sets["d0"]["evidence_key"]
        xs.append(x)
        for d in (0, 2, 4):
            row = sets[f"d{d}"]
            named = [t["conclusion"] for t in row["triplets"] if not t["distractor"]]
            assert row["evidence_key"] == x and named == [row["options"][x]] and row["n_distractors"] == d
        gold = sets["gold_evidence"]
        assert [t["conclusion"] for t in gold["triplets"] if not t["distractor"]] == [gold["options"][gold["gold"]]]
        assert NO_EVIDENCE in sets["no_evidence"]["prompt"][-1]["content"]
    assert len(set(xs)) > 1 and sum(x == q.answer for x, q in zip(xs, heldout)) < len(xs)  # X is not the gold


def test_figures_count_follows_and_right_answers_per_set() -> None:
    bench = bench_module("evidence_following")
    kept = [
        {"set": "d2", "answer": "B", "evidence_key": "B", "gold": "A", "well_formed": True},
        {"set": "d2", "answer": "A", "evidence_key": "C", "gold": "A", "well_formed": True},
        {"set": "d2", "answer": None, "evidence_key": "D", "gold": "D", "well_formed": False},
    ]
    d2 = bench.figures(kept)["d2"]
    assert (d2["follow_rate"]["hits"], d2["accuracy"]["hits"], d2["well_formed"]["hits"]) == (1, 1, 2)
    assert d2["follow_rate"]["n"] == 3 and d2["modal_answer_share"] == round(1 / 3, 4)
    assert "example_letter" not in d2  # replies kept before the example's letter was
    ordinary = [{**k, "set": "ordinary", "evidence_key": None, "quoted_key": None} for k in kept]
    figures = bench.figures(ordinary)["ordinary"]  # no X: accuracy and form only, never a follow or a quote
    assert figures["accuracy"]["hits"] == 1 and not {"follow_rate", "quotes_evidence"} & set(figures)
    with_example = [{**k, "example_key": key} for k, key in zip(kept, ("B", "C", "D"))]
    assert bench.figures(with_example)["d2"]["example_letter"]["hits"] == 1  # a missing answer copies nothing


def test_the_quoted_option_is_the_longest_option_text_in_the_reasoning_only() -> None:
    bench = bench_module("evidence_following")
    options = {"A": "Antegrade", "B": "Antegrade and  retrograde", "C": "Cefaclor", "D": ""}
    assert bench.quoted_option("<think>Evidence [1] says antegrade and retrograde.</think>", options) == "B"
    assert bench.quoted_option("<think>says cefaclor</think><answer>C</answer>", options) == "C"
    assert bench.quoted_option("<think>nothing</think><answer>Cefaclor</answer>", options) is None  # not its answer
    kept = [{"set": "d2", "answer": "D", "evidence_key": "C", "gold": "A", "well_formed": True, "quoted_key": "C"}]
    d2 = bench.figures(kept)["d2"]
    assert d2["quotes_evidence"]["hits"] == 1 and d2["answers_what_it_quoted"]["hits"] == 0


def test_the_no_example_arm_drops_the_worked_example_and_nothing_else(shared_data: Path) -> None:
    bench = bench_module("evidence_following")
    heldout, pool = bench.pools(shared_data, 300, 4)
    row = bench.heldout_rows(heldout, pool)[1]
    stripped = bench.without_example(row["prompt"])
    assert stripped == [row["prompt"][0], row["prompt"][3]] and worked_example_answer(stripped) is None
    with pytest.raises(ValueError, match="roles"):
        bench.without_example(stripped)  # not a prompt with an example: refused, never cut wrongly


ARGS = ["--sft-prompts", "64", "--train-prompts", "16", "--ordinary-questions", "40"]


def test_the_ordinary_questions_are_unseen_by_every_seeds_training(shared_data: Path) -> None:
    """Neither asked in any recorded seed's export nor shown there as a line (a distractor names its gold)."""
    bench = bench_module("evidence_following")
    args = bench.parse_args(["--seeds", "2", *ARGS])
    heldout, pool = bench.pools(shared_data, 300, 8)
    ordinary = bench.ordinary_questions(args, pool)
    assert len(ordinary) == 40 and Counter(q.answer for q in ordinary) == {k: 10 for k in "ABCD"}
    assert not {q.id for q in ordinary} & {q.id for q in heldout}
    for seed in (0, 1):
        export = bench.evidence_prompts(pool, bench.export_config(seed, "", 64))
        shown = {t["conclusion"] for row in export for t in row["triplets"]}
        assert not {q.id for q in ordinary} & {row["run_id"] for row in export}
        assert not any(q.options[q.answer] in shown for q in ordinary)
    rows = [r for r in bench.heldout_prompts(args, heldout, pool) if r["set"] == bench.ORDINARY]
    assert len(rows) == 40 and all(r["triplets"] == [] and r["evidence_key"] is None for r in rows)
    with pytest.raises(SystemExit, match="unseen by training"):
        bench.ordinary_questions(bench.parse_args(["--ordinary-questions", str(len(pool))]), pool)
    # a record's set is kept as it is when seeds are added, and refused where a new seed's training saw it
    recorded = [q.id for q in ordinary]
    grown = bench.parse_args([*ARGS, "--first-seed", "2", "--seeds", "1"])
    assert bench.ordinary_questions(grown, pool, recorded) == ordinary
    seed2 = {row["run_id"] for row in bench.evidence_prompts(pool, bench.export_config(2, "", 64))}
    with pytest.raises(SystemExit, match="in these seeds' training"):
        bench.ordinary_questions(grown, pool, [*recorded[:39], sorted(seed2)[0]])


def test_a_reused_models_kept_replies_are_kept_and_only_new_prompts_asked(monkeypatch, tmp_path: Path) -> None:
    bench = bench_module("evidence_following")
    options = {"A": "Insulin", "B": "Metformin"}
    rows = [
        {
            "prompt_id": f"q{i}:ordinary",
            "set": "ordinary",
            "prompt": [{"role": "user", "content": f"q{i}"}],
            "options": options,
            "gold": "A",
            "evidence_key": None,
        }
        for i in range(3)
    ]
    asked: list[str] = []

    def generate(model, prompts, tokens, stop):
        asked.extend(p[-1]["content"] for p in prompts)
        return ["<think>x</think><answer>A</answer>"] * len(prompts)

    monkeypatch.setattr(bench, "generate", generate)
    replies, model = tmp_path / "after.jsonl.gz", tmp_path / "model"
    bench.measure(str(model), rows[:2], 8, replies)
    assert asked == ["q0", "q1"]
    kept = bench.measure(str(model), rows, 8, replies, reuse=True)
    assert asked == ["q0", "q1", "q2"] and [k["prompt_id"] for k in kept] == [r["prompt_id"] for r in rows]
    bench.measure(str(model), rows, 8, replies)  # without --reuse: everything asked again
    assert asked[3:] == ["q0", "q1", "q2"]
    del asked[:]
    bench.measure(str(model), rows, 16, replies, reuse=True)  # another budget: other replies
    model.mkdir()
    (model / bench_module("seeds").RUN_FILE).write_text("{}")  # the same path trained again: another model
    bench.measure(str(model), rows, 16, replies, reuse=True)
    changed = [{**rows[0], "prompt": [{"role": "user", "content": "q0, its options moved"}]}]
    bench.measure(str(model), changed, 16, replies, reuse=True)  # the same prompt id asked otherwise
    assert asked == ["q0", "q1", "q2"] * 2 + ["q0, its options moved"]


def smoke_run(shared_data: Path, work: Path, *options: str) -> dict:
    """The bench's `--smoke` run (one seed, one thread) with `options`; its record."""
    env = {**os.environ, "ERMEDRAG_TORCH_THREADS": "1"}
    command = [sys.executable, str(SCRIPT), "--smoke", "--seeds", "1", "--data", str(shared_data), *options]
    done = subprocess.run(
        [*command, "--work", str(work)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads((work / "smoke" / "evidence_following.json").read_text())


@pytest.mark.slow  # ~40 s: `make test-all` (the fast suite keeps its 10-minute budget)
def test_smoke_run_records_baselines_seeds_and_kept_replies(shared_data: Path, tmp_path: Path) -> None:
    result = smoke_run(shared_data, tmp_path)
    assert set(result["baselines"]) == {"chance", "no_evidence", "copy_example"}
    assert result["baselines"]["chance"] == 0.25
    seeds = result["seeds"]
    assert seeds["n"] == 1 and set(seeds["follow_rate"]) == {"d0", "d2", "d4"}
    assert len(seeds["follow_rate"]["d2"]["after"]["values"]) == 1 and "accuracy_gold_evidence" in seeds
    assert result["runs"][0]["export"]["rows"] == 4 and "seed_changes" in result["runs"][0]
    change = result["runs"][0]["ordinary_change"]  # the same 4 unseen questions, before and after, paired
    assert change["n"] == 4 and seeds["accuracy_ordinary"]["before"] == change["right_before"] / 4
    replies = tmp_path / "smoke" / "evidence_following" / "replies"
    for phase in ("before", "seed0_after"):
        with gzip.open(replies / f"{phase}.jsonl.gz", "rt") as kept:
            lines = [json.loads(line) for line in kept]
        assert len(lines) == 24 and {"prompt_id", "reply", "answer", "gold", "evidence_key", "example_key"} <= set(
            lines[0]
        )


@pytest.mark.slow  # ~40 s: `make test-all`
def test_smoke_run_warm_starts_with_sft_then_trains_grpo_from_it(shared_data: Path, tmp_path: Path) -> None:
    """`--sft-prompts N`: the product's SFT on the export's reference replies, then GRPO from its merged model."""
    result = smoke_run(shared_data, tmp_path, "--sft-prompts", "8")
    run = result["runs"][0]
    assert run["steps"] == 2 and run["sft"]["export"]["rows"] == 8 and run["sft"]["steps"] >= 1  # smoke: 2 GRPO steps
    (export,) = tmp_path.rglob("sft-export-s0")  # the kinds recorded are those of the export it trained on
    assert run["sft"]["export"]["kinds"] == dict(Counter(load_from_disk(str(export / "dataset"))["kind"]))
    assert set(run["sft"]["export"]["kinds"]) <= {"supporting", "irrelevant", "no_evidence"}
    assert result["settings"]["sft_warm_start"] == {"prompts": 8, "epochs": 1.0}
    assert "quotes_evidence" in run["after"]["d2"]
