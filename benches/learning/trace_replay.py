"""Do the learning bench's recorded extractor completions come back when generated again on this machine?

The held-out and training prompts of the learning bench are built from recorded ER-MedRAG runs, so a before can be
shared by seeds trained in different sessions only if recording repeats itself. This regenerates the first `--n`
recorded extractor prompts of learning_signal.py's held-out traces greedily, as the graph did (same model, token
budget and stop strings), and counts the completions identical to the recorded ones. Run it once per batching
setting to tell batching from hardware: `ERMEDRAG_HF_MAX_BATCH=1` generates each prompt alone, the default (8)
batches them.

    ERMEDRAG_HF_MAX_BATCH=1 .venv/bin/python benches/learning/trace_replay.py --n 16
    .venv/bin/python benches/learning/trace_replay.py --n 16
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from learning_signal import generate  # also puts the library offline
from seeds import LEARNING_WORK, learning_run

from ermedrag.agents import extractor
from ermedrag.tools.machine import cpu_model
from ermedrag.tools.records.traces import TraceStore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default=str(LEARNING_WORK), help="learning_signal.py's --work")
    parser.add_argument("--n", type=int, default=16, help="recorded extractor prompts to generate again")
    args = parser.parse_args()
    traces = learning_run(Path(args.work)) / "traces-eval.sqlite"
    if not traces.exists():
        sys.exit(
            f"error: no recorded traces at {traces}: run benches/learning/learning_signal.py first (or give its --work)"
        )
    events = list(TraceStore(traces).events(agent="extractor"))[: max(args.n, 1)]
    budgets = {event["sampling"]["max_new_tokens"] for event in events}
    if len(budgets) != 1:
        sys.exit(f"error: the recorded extractor calls used several token budgets {sorted(budgets)}")
    replies = generate(events[0]["model"], [event["messages"] for event in events], budgets.pop(), extractor.STOP)
    differ = [i for i, (reply, event) in enumerate(zip(replies, events)) if reply != event["completion"]]
    print(
        json.dumps(
            {
                "max_batch": int(os.environ.get("ERMEDRAG_HF_MAX_BATCH", 8)),
                "prompts": len(events),
                "identical_to_recorded": len(events) - len(differ),
                "differ_at": differ,
                "cpu": cpu_model(),
            }
        )
    )


if __name__ == "__main__":
    main()
