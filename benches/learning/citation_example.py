"""Does the respondent's worked example make the model cite its evidence? Three examples on the same prompts.

The GRPO evidence reward (`training.answer_rewards.evidence_use_reward`) pays a correct answer whose reasoning
restates a triplet that is not a distractor and names none but the lines it restates. Before training, the offline
270M base model does so in about 1 reply of 48, so the reward rarely fires and GRPO has little to reinforce
(benches/README, issue 15). The model copies its worked example closely (`benches/prompt_bias`), so the example is
a lever on that base rate. Arms (`worked_examples.EXAMPLES`), on the learning bench's held-out respondent prompts
(recorded ER-MedRAG runs with distractor triplets), differing only in the worked example:

- `current`: the prompts as recorded (`agents.respondent.example`: "The evidence says vitamin D deficiency ...");
- `cites_number`: the same example citing its evidence line by number ("Evidence 1 says ...");
- `cites_among_two`: the example shows two evidence lines, and its reasoning cites the relevant second one by
  number and sets the first aside: a model that copies "evidence 1" blindly cites a distractor where one is
  first (17 of the 48 prompts).

Per arm, greedy at the graph's respondent budget: every reward component, accuracy, reasoning length, and the
numbered citations split into those of a relevant triplet and those of a distractor, and the replies that name a
line without using its words, so that a reward gained by copying a number shows as such.

    .venv/bin/python benches/learning/learning_signal.py --parts grpo     # first: records the held-out prompts
    .venv/bin/python benches/learning/citation_example.py                 # 65 min on 2 cores shared with a training
    .venv/bin/python benches/learning/citation_example.py --rescore       # the recorded replies, today's rewards

`--rescore` scores the replies a recorded result holds with the rewards as they are now (seconds, no model), so a
change to a reward shows on the very same replies; it refuses held-out prompts other than those the replies answered
(`prompts_sha256`: a rerun of the learning bench without `--reuse` exports new ones).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from learning_signal import REPO, command_line, generate, respondent_metrics  # also puts the library offline

from datasets import load_from_disk

from ermedrag.agents import respondent
from ermedrag.graphs.context import Context
from ermedrag.tools.records.jsonl import replace_text
from ermedrag.tools.models.offline import offline_model_dir
from ermedrag.training.rewards.answers import numbered_triplets
from seeds import LEARNING_WORK, grpo_prompts, learning_run
from worked_examples import EXAMPLES

RESULT = REPO / "benches" / "results" / "citation_example.json"


def distractor_first(row: dict[str, Any]) -> bool:
    """Evidence line 1 is a distractor: where copying an example's "Evidence 1" cites one."""
    shown = numbered_triplets(row["triplets"])
    return bool(shown) and shown[0]["number"] == 1 and shown[0]["distractor"]


def prompts_sha256(rows: list[dict[str, Any]]) -> str:
    """A fingerprint of the held-out rows a result answered: what each reply is scored against."""
    scored = [[row.get(key) for key in ("question", "options", "gold", "triplets")] for row in rows]
    return hashlib.sha256(json.dumps(scored, sort_keys=True, default=str).encode()).hexdigest()


def rescore(result: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The recorded result with each arm's figures computed again from its recorded replies."""
    if result.get("prompts_sha256") != prompts_sha256(rows):
        sys.exit(
            "error: the held-out prompts in --work are not the ones the recorded replies answered "
            f"(prompts_sha256 {result.get('prompts_sha256')} recorded, {prompts_sha256(rows)} now)"
        )
    arms = {}
    for arm, recorded in result["arms"].items():
        figures = respondent_metrics(recorded["replies"], rows)
        arms[arm] = {**recorded, **figures}
        print(f"{arm}: {json.dumps(figures)}", flush=True)
    return {**result, "arms": arms, "rescored": {"date": time.strftime("%Y-%m-%d"), "command": command_line()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--work",
        default=str(LEARNING_WORK),
        help="learning_signal.py's --work (its run folder holds the held-out prompts)",
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=Context().respondent_max_new_tokens,
        help="respondent tokens (default: the graph's respondent_max_new_tokens)",
    )
    parser.add_argument("--out", default=str(RESULT))
    parser.add_argument(
        "--rescore",
        action="store_true",
        help="score the replies recorded in --out again with the current rewards (no model)",
    )
    args = parser.parse_args()
    dataset = grpo_prompts(learning_run(Path(args.work)), "eval")
    if not dataset.exists():
        sys.exit(
            f"error: no held-out prompts at {dataset}: run benches/learning/learning_signal.py --parts grpo "
            "first (or give its --work)"
        )
    rows = [dict(row) for row in load_from_disk(str(dataset))]
    if args.rescore:
        result = rescore(json.loads(Path(args.out).read_text()), rows)
        replace_text(Path(args.out), json.dumps(result, indent=2) + "\n")
        return
    model = f"hf:{offline_model_dir()}"
    started, result, answers = time.time(), {"arms": {}}, {}
    for arm, rewrite in EXAMPLES.items():
        arm_started = time.time()
        completions = generate(model, [rewrite(row["prompt"]) for row in rows], args.tokens, respondent.STOP)
        figures = respondent_metrics(completions, rows)
        answers[arm] = [respondent.parse_answer(c, row["options"]).get("answer") for c, row in zip(completions, rows)]
        result["arms"][arm] = {**figures, "minutes": round((time.time() - arm_started) / 60, 1), "replies": completions}
        print(f"{arm}: {json.dumps(figures)}", flush=True)
    result.update(
        prompts=len(rows),
        prompts_sha256=prompts_sha256(rows),
        distractor_first=sum(map(distractor_first, rows)),
        tokens=args.tokens,
        model="gemma3-270m (base), greedy",
        same_answer_as_current={
            arm: sum(a == b for a, b in zip(answers[arm], answers["current"])) / len(rows)
            for arm in EXAMPLES
            if arm != "current"
        },
        minutes=round((time.time() - started) / 60, 1),
        command=command_line(),
    )
    replace_text(Path(args.out), json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
