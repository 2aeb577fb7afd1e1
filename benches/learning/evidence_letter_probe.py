"""Can the model turn evidence it has quoted into the option's letter? (issue 39, part 5: why evidence following fails)

The evidence-following bench (`evidence_following.py`) asks the respondent questions whose evidence names option
X's text; the offline model answers X no more often than chance, before and after GRPO. This probe separates
reading the evidence from answering with a letter: the model's reasoning is written for it (teacher forcing)
and its next token after `<answer>` is read exactly, through the product's answer-scoring call (the graphs'
`with_confidence`: `score_tokens`, `agents.confidence.option_probabilities`). The answer is the most probable
option letter. Reasoning written for it:
- `no_quote`: `<think></think>` (nothing read);
- `quotes_line`: the evidence line naming X, quoted whole (`Evidence [k] says condition — relation — conclusion`);
- `quotes_conclusion`: only that line's conclusion, which is X's text;
- `keys_after_text`: every option printed with its key after its text as well (`C. text (C)`, the worked example's
  too), the reasoning quoting the conclusion and going on with ` (`: the letter is then what followed that text in
  the list, a forward copy, not a look-up of what stood before it.
A model that can map a quoted option text to its letter follows X far above chance once the reasoning quotes it.
Same held-out prompts as the bench (its `d0`, `d2` and `gold_evidence` sets; follow rate = share of answers equal
to the line's option, X or the gold), each with its Wilson 95% interval, chance beside it.

    .venv/bin/python benches/learning/evidence_letter_probe.py --data ../shared/data              # ≈ 10 min
    .venv/bin/python benches/learning/evidence_letter_probe.py --trained PATH --label seed0        # a merged model too
    .venv/bin/python benches/learning/evidence_letter_probe.py --smoke                             # tiny random model
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from evidence_following import heldout_rows, pools, write_with_provenance  # noqa: E402  (goes offline at import, via learning_signal)
from learning_signal import log  # noqa: E402
from seeds import LEARNING_WORK  # noqa: E402

from ermedrag.agents.base import to_langchain  # noqa: E402
from ermedrag.agents.confidence import option_probabilities  # noqa: E402
from ermedrag.evals.baselines import share  # noqa: E402

RESULT = REPO / "benches" / "results" / "evidence_letter_probe.json"
SETS = ("d0", "d2", "gold_evidence")
VARIANTS = ("no_quote", "quotes_line", "quotes_conclusion", "keys_after_text")
OPTION_LINE = re.compile(r"([A-Z])\. (.*)")


def named_line(row: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """The evidence line that names the row's option (its only non-distractor triplet) and its number as shown."""
    for number, triplet in enumerate(row["triplets"], 1):
        if not triplet.get("distractor"):
            return number, triplet
    raise ValueError(f"{row['prompt_id']}: no evidence line names an option")


def reasoning(row: dict[str, Any], variant: str) -> str:
    """What the model is made to have written before its answer letter."""
    if variant == "no_quote":
        return "<think></think><answer>"
    number, line = named_line(row)
    if variant == "keys_after_text":
        return f"<think>Evidence [{number}] says {line['conclusion']} ("
    quoted = (
        f"{line['condition']} — {line['relation']} — {line['conclusion']}"
        if variant == "quotes_line"
        else line["conclusion"]
    )
    return f"<think>Evidence [{number}] says {quoted}</think><answer>"


def keys_after_text(prompt: list[dict[str, str]]) -> list[dict[str, str]]:
    """The prompt with every option line of its user turns ending in its key as well: `C. text` → `C. text (C)`."""
    shown = []
    for message in prompt:
        if message["role"] != "user" or "\nOptions:\n" not in message["content"]:
            shown.append(message)
            continue
        head, options = message["content"].split("\nOptions:\n", 1)
        lines = [OPTION_LINE.sub(r"\1. \2 (\1)", line) for line in options.split("\n")]
        shown.append({**message, "content": head + "\nOptions:\n" + "\n".join(lines)})
    return shown


def answers(model_spec: str, rows: Sequence[dict[str, Any]], variant: str) -> list[str | None]:
    """The most probable option letter after each row's written reasoning (None: no letter was scored)."""
    from langchain_core.messages import AIMessage

    from ermedrag.tools.models import load_chat_model

    model = load_chat_model(model_spec, max_new_tokens=1)
    picked: list[str | None] = []
    for row in rows:  # one call each: the letters scored are the row's own options
        prompt = keys_after_text(row["prompt"]) if variant == "keys_after_text" else row["prompt"]
        messages = [*to_langchain(prompt), AIMessage(content=reasoning(row, variant))]
        reply = model.invoke(messages, score_tokens=list(row["options"]))
        first = ((reply.response_metadata.get("logprobs") or {}).get("content") or [{}])[0]
        probs = option_probabilities(first.get("top_logprobs"), row["options"])
        picked.append(max(probs, key=probs.__getitem__) if probs else None)
    return picked


def probe(model_spec: str, rows: Sequence[dict[str, Any]], variants: Sequence[str]) -> dict[str, Any]:
    """Per variant and set: how often the answer is the option the evidence line names."""
    result: dict[str, Any] = {}
    for variant in variants:
        picked = answers(model_spec, rows, variant)
        result[variant] = {}
        for name in SETS:
            hits = [p == r["evidence_key"] for p, r in zip(picked, rows) if r["set"] == name]
            result[variant][name] = share(sum(hits), len(hits))
        log(f"{model_spec} {variant}: " + ", ".join(f"{n} {result[variant][n]['hits']}" for n in SETS))
    return result


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=os.environ.get("ERMEDRAG_SHARED_DATA", str(REPO.parent / "shared" / "data")))
    parser.add_argument("--out", default=str(RESULT))
    parser.add_argument("--work", default=str(LEARNING_WORK / "evidence_letter_probe"), help="--smoke's model, result")
    parser.add_argument("--eval-questions", type=int, default=48)
    parser.add_argument("--max-question-chars", type=int, default=300)
    parser.add_argument("--trained", action="append", default=[], help="a merged model to probe too (repeatable)")
    parser.add_argument("--label", action="append", default=[], help="its name in the results, in --trained order")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--reuse", action="store_true", help="keep what --out holds for the same models; add the rest")
    parser.add_argument("--smoke", action="store_true", help="a tiny random model and 4 questions: the pipeline")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    data = Path(args.data)
    if not (data / "benchmarks").is_dir():
        raise SystemExit(f"no benchmarks under {data} (pass --data or set ERMEDRAG_SHARED_DATA)")
    if len(args.label) not in (0, len(args.trained)):
        raise SystemExit(f"--label given {len(args.label)} times for {len(args.trained)} --trained models")
    if args.smoke:
        from ermedrag.testing.tiny_model import build_tiny_causal_lm

        args.eval_questions = 4
        base = build_tiny_causal_lm(Path(args.work) / "tiny")
        out = Path(args.work) / "evidence_letter_probe.json"
    else:
        from ermedrag.tools.models.offline import offline_model_dir

        base, out = str(offline_model_dir()), Path(args.out)
    heldout, pool = pools(data, args.max_question_chars, args.eval_questions)
    rows = [row for row in heldout_rows(heldout, pool) if row["set"] in SETS]
    labels = args.label or [Path(path).name for path in args.trained]
    models = {"base": str(base), **dict(zip(labels, args.trained))}
    variants = [v for v in args.variants.split(",") if v]
    if unknown := sorted(set(variants) - set(VARIANTS)):
        raise SystemExit(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    earlier = json.loads(out.read_text()).get("models", {}) if args.reuse and out.exists() else {}
    started = time.time()
    probed = {}
    for label, path in models.items():
        kept = earlier.get(label, {}) if earlier.get(label, {}).get("path") == path else {"path": path}
        todo = [v for v in variants if v not in kept]
        probed[label] = {**kept, **probe(f"hf:{path}", rows, todo)}
    result = {
        "models": probed,
        "chance": round(sum(1 / len(r["options"]) for r in rows) / len(rows), 4),
        "settings": {
            "held_out": f"evidence_following.py's held-out prompts ({args.eval_questions} questions), sets {SETS}",
            "answer": "the most probable option letter after the written reasoning (exact next-token scores)",
            "variants": list(VARIANTS),
        },
    }
    write_with_provenance(out, result, started)
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
