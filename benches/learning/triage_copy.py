"""Does the triage doctor copy its worked example, and does its triage beat trivial ones? (issue 39, part 6)

On the held-out questions of `mmedagent_learning.py` (the same labelled questions, split and seed: balanced over
the specialties that MedMCQA subjects and MedXpertQA body systems name), the model triages each case greedily with
the graph's own prompt (`agents.triage.triage_messages`, the paper's seven specialties) and stop string, in
process. Beside its accuracy, on the same questions:
- `chance`: 1 / the number of specialties listed; `majority`: the held-out set's most common gold specialty;
  `first_option`: always the first specialty of the list;
- `copy_example`: answering with the worked example's specialty (right only when the example can be right);
- `keyword`: a rule that names the specialty whose words (biopsy, X-ray, thyroid, …: `KEYWORDS`) the case uses most.
`copy_rate` is the share of replies that name the worked example's specialty; `modal_share` the share of the most
common reply (a collapse detector). Wilson 95% intervals on every rate.

The prompt is that of the ermedrag it imports: to measure another commit's, run this script with that checkout first
on PYTHONPATH and its .venv (a checkout with `evals/baselines.py`: 7d22253 or later); `--label` names the row. Replies are kept beside the JSON (`<out>_replies/LABEL.jsonl.gz`).

    .venv/bin/python benches/learning/triage_copy.py --data ../shared/data --label after
    cd ../old && PYTHONPATH=. .venv/bin/python ../main/benches/learning/triage_copy.py --data ../shared/data \\
        --label before --out ../main/benches/results/triage_copy.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
# The helpers come from this script's own folder, whatever checkout PYTHONPATH names first for ermedrag.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kept_replies import replies_path, write_replies  # noqa: E402
from mmedagent_learning import (  # noqa: E402
    benchmarks_dir,
    case_keyword,
    copied_example,
    labelled_questions,
    reply_key,
    split_questions,
    triage_baselines,
)
from ermedrag.evals.baselines import beats_baselines, share, worked_example_answer  # noqa: E402
from ermedrag.agents import triage  # noqa: E402
from ermedrag.offline import go_offline  # noqa: E402
from ermedrag.tools.agent_calls import text_with_stop  # noqa: E402
from ermedrag.tools.data.specialties import gold_specialty_for  # noqa: E402
from ermedrag.tools.machine import describe_machine  # noqa: E402


def triage_replies(model_spec: str, conversations: list[list[Any]], concurrency: int) -> list[str]:
    from ermedrag.tools.models import load_chat_model

    model = load_chat_model(model_spec, temperature=0.0, max_new_tokens=triage.TRIAGE_MAX_NEW_TOKENS)
    replies = model.batch(conversations, config={"max_concurrency": concurrency}, stop=list(triage.STOP))
    return [text_with_stop(reply, list(triage.STOP)) for reply in replies]


def measure(questions: Sequence[Any], args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    specialties = list(triage.SPECIALTIES)
    conversations = [triage.triage_messages(q.question, q.options, specialties) for q in questions]
    golds = [gold_specialty_for(q) for q in questions]
    examples = [worked_example_answer(c) for c in conversations]
    started = time.time()
    texts = triage_replies(args.model, conversations, args.concurrency)
    seconds = time.time() - started
    rows, said = [], []
    for q, gold, example, text in zip(questions, golds, examples, texts):
        parsed = triage.parse_triage(text, specialties, specialties[0])
        said.append(reply_key(parsed))
        named = parsed["specialty"] if parsed["ok"] else None
        rows.append(
            {
                "id": q.id,
                "gold": gold,
                "example": example,
                "reply": text,
                "answer": parsed["answer"],
                "named": named,
                "copied": copied_example(parsed, example),
                "keyword": case_keyword(q, specialties),
            }
        )
    n = len(rows)
    modal = Counter(said).most_common(1)[0][1] if said else 0
    figures = {
        "n": n,
        "accuracy": share(sum(r["named"] == r["gold"] for r in rows), n),
        "named_a_specialty": share(sum(r["named"] is not None for r in rows), n),
        "copy_rate": share(sum(r["copied"] for r in rows), n),
        "modal_share": share(modal, n),
        "predicted": dict(Counter(r["named"] or "(none)" for r in rows).most_common()),
        "examples_shown": dict(Counter(r["example"] or "(none)" for r in rows).most_common()),
        "seconds": round(seconds, 1),
        "baselines": triage_baselines(questions, conversations, specialties),
    }
    figures["beats_every_baseline"] = beats_baselines(figures["accuracy"]["rate"], figures["baselines"])
    return figures, rows


def commit() -> str:
    """The commit of the ermedrag this run imported, `-dirty` when its checkout has uncommitted changes."""
    import ermedrag

    where = str(Path(ermedrag.__file__).resolve().parents[1])
    head = subprocess.run(["git", "-C", where, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    changed = subprocess.run(["git", "-C", where, "status", "--porcelain", "-uno"], capture_output=True, text=True)
    return (head.stdout.strip() or "unknown") + ("-dirty" if changed.stdout.strip() else "")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=os.environ.get("ERMEDRAG_SHARED_DATA", str(REPO.parent / "shared" / "data")))
    parser.add_argument("--model", default="llamacpp:gemma3-270m", help="the triage doctor's model")
    parser.add_argument("--label", default="after", help="the row this run writes (e.g. before, after)")
    parser.add_argument("--seed", type=int, default=0, help="the question split (mmedagent_learning.py's --seed)")
    parser.add_argument("--train-questions", type=int, default=48)
    parser.add_argument("--eval-questions", type=int, default=48)
    parser.add_argument("--max-question-chars", type=int, default=1500)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--out", default=str(REPO / "benches" / "results" / "triage_copy.json"))
    args = parser.parse_args(argv)
    folder = benchmarks_dir(args.data)
    if folder is None:
        print(f"no labelled benchmarks under {args.data} (MedMCQA dev and MedXpertQA): nothing to measure")
        return 0
    go_offline()
    by_specialty = labelled_questions(folder, args.max_question_chars)
    _, held_out = split_questions(by_specialty, args.train_questions, args.eval_questions, args.seed, "balanced")
    load_before = os.getloadavg()
    figures, rows = measure(held_out, args)
    out = Path(args.out)
    record = json.loads(out.read_text()) if out.exists() else {}
    record.setdefault("runs", {})
    record["runs"][args.label] = {
        "commit": commit(),
        "model": args.model,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "data", "label")},
        "machine": describe_machine(),
        "load_average": {"before": load_before, "after": os.getloadavg()},
        **figures,
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    write_replies(replies_path(out.with_name(out.stem + "_replies"), args.label), rows)
    base = figures["baselines"]
    print(
        f"{args.label} ({record['runs'][args.label]['commit']}): accuracy {figures['accuracy']['rate']} "
        f"{figures['accuracy']['ci95']}, copy rate {figures['copy_rate']['rate']}, named a specialty "
        f"{figures['named_a_specialty']['rate']}, modal share {figures['modal_share']['rate']}; baselines: chance "
        f"{base['chance']}, majority {base['majority']['rate']}, first listed {base['first_option']['rate']}, "
        f"copy-the-example {base['copy_example']['rate']}, keyword {base['keyword']['rate']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
