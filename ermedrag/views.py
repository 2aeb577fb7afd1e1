"""What `ask` and `traces show` print: a run and a recorded run as a person reads them."""

from __future__ import annotations

import time
from typing import Any


def render_run(state: dict[str, Any], this_time_s: float, resumed: bool = False) -> str:
    """What `ask` prints: the question, what the graph's stages produced (the sections its state has), the answer,
    and the time: the stages' own (over every process that worked on the run) and this process's work."""
    lines = [f"Question: {state['question']}"]
    for key, text in (state.get("options") or {}).items():
        lines.append(f"  {key}. {text}")
    if "snippets" in state:
        lines.append(f"\nRetrieved snippets ({len(state['snippets'])}):")
        for i, s in enumerate(state["snippets"], 1):
            lines.append(f"  [{i}] {s['id']}  score={s['score']:.3f}  source={s['source']}  title={s['title']!r}")
            lines.append(f"      {s['text'][:240]}")
    if "extractions" in state:
        lines.append("\nExtracted triplets:")
        for extraction in state["extractions"]:
            status = "ok" if extraction["ok"] else f"unparsed ({extraction['error']})"
            lines.append(f"  from {extraction['snippet_id']}: {status}")
            for t in extraction["triplets"]:
                lines.append(f"    ({t['condition']}) —[{t['relation']}]→ ({t['conclusion']})")
    if "searches" in state:
        lines.append(f"\nSearches ({len(state['searches'])}):")
        lines.extend(f"  {s['query']!r} → {', '.join(s['snippet_ids']) or 'no results'}" for s in state["searches"])
    if "specialty" in state:
        lines.extend(_panel_lines(state))
    answer = state.get("answer", {})
    lines.append(f"\nReasoning: {answer.get('reasoning', '')[:400]}")
    lines.append(
        f"Answer: {answer.get('answer')}  (parsed={answer.get('ok')}, well-formed={answer.get('well_formed')}"
        + (", read back from its reasoning" if answer.get("extracted") else "")
        + (f", error={answer.get('error')}" if answer.get("error") else "")
        + ")"
    )
    lines.extend(_certainty_lines(answer))
    lines.extend(_citation_lines(answer))
    setup = state.get("setup") or {}
    if setup:
        parts = ", ".join(f"{k.removesuffix('_s')}={v:.2f}s" for k, v in setup.items() if k != "setup_s")
        lines.append(
            f"Setup{' of this resume' if resumed else ''}: {setup.get('setup_s', 0):.2f}s ({parts or 'nothing to load'})"
        )
    timings = state.get("timings", {})
    stages = ", ".join(f"{k}={v:.2f}s" for k, v in timings.items())
    if resumed:
        lines.append(f"Timings of the run's stages: {stages or 'none recorded'}; this resume took {this_time_s:.2f}s")
    else:
        lines.append(f"Timings: {stages}, total={this_time_s:.2f}s")
    lines.append(f"Run id: {state.get('run_id')} (see `ermedrag traces show {state.get('run_id')}`)")
    return "\n".join(lines)


def _panel_lines(state: dict[str, Any]) -> list[str]:
    """MMedAgent-RL's triage and the specialists' opinions."""
    triage = state.get("triage") or {}
    fell_back = f" (fell back: {triage.get('reason')})" if triage.get("fell_back") else ""
    lines = [f"\nTriage: {state['specialty']}{fell_back}", "Specialists:"]
    for o in state.get("opinions", []):
        lines.append(
            f"  {o['specialist']} ({o['specialty']}, {o['model']}): answer {o['answer']}  "
            f"{' '.join(str(o.get('reasoning', '')).split())[:160]}"
        )
    lines.append(
        f"Majority: {state.get('majority')}  bucket: {state.get('bucket')}  "
        f"attending followed it: {state.get('followed_majority')}"
    )
    return lines


def render_trace(run: dict[str, Any], events: list[dict[str, Any]], retrievals: list[dict[str, Any]]) -> str:
    """A recorded run as a person reads it: the question, each step in the order it ran (retrievals with their
    snippets; model calls with what they wrote, how they ended, their tokens and time), and the answer."""
    question = run.get("question") or {}
    lines = [
        f"Run {run['run_id']} ({run['graph']}, {run['status']}, {when(run['created_at'])})",
        f"Question: {question.get('question')}",
    ]
    lines += [f"  {key}. {text}" for key, text in (question.get("options") or {}).items()]
    if run.get("gold"):
        lines.append(f"Gold: {run['gold']}")
    if run.get("setup"):
        lines.append("Setup: " + ", ".join(f"{k}={v:.2f}s" for k, v in run["setup"].items()))
    steps = sorted(
        [("retrieval", r) for r in retrievals] + [("call", e) for e in events],
        key=lambda step: step[1].get("created_at") or 0,
    )
    lines.append(f"\nSteps ({len(steps)}):")
    for kind, step in steps:
        if kind == "retrieval":
            lines.append(f"  [{step['node']}] retrieve {one_line(step['query'], 120)!r}: {step['latency_s']:.2f}s")
            lines += [f"      {line}" for line in retrieval_view(step)["snippets"]]
            continue
        usage = step.get("usage") or {}
        ended = step.get("finish_reason") or "?"
        if step.get("stop_sequence"):
            ended += f" at {step['stop_sequence']!r}"
        lines.append(
            f"  [{step['node']}] {step['agent']} ({step['model']}): {usage.get('output_tokens', '?')} tokens, "
            f"{step['latency_s']:.2f}s, ended {ended}"
        )
        lines.append(f"      wrote: {one_line(step['completion'], 300)!r}")
        for triplet in ((step.get("parsed") or {}).get("triplets") or [])[:8] if step["agent"] == "extractor" else []:
            lines.append(f"      ({triplet['condition']}) —[{triplet['relation']}]→ ({triplet['conclusion']})")
    answer = run.get("answer") or {}
    if answer:
        lines.append(
            f"\nAnswer: {answer.get('answer')}  (well-formed={answer.get('well_formed')}, error={answer.get('error')})"
        )
        lines.extend(_citation_lines(answer))
    if run.get("error"):
        lines.append(f"\nFailed: {one_line(run['error'], 500)}")
    return "\n".join(lines)


def _certainty_lines(answer: dict[str, Any]) -> list[str]:
    """How sure the answer is: its confidence and option probabilities, its conformal set, an abstention."""
    lines = []
    probs = answer.get("option_probs")
    if probs:
        ranked = ", ".join(f"{key}={p:.2f}" for key, p in sorted(probs.items(), key=lambda kv: -kv[1]))
        lines.append(f"Confidence: {answer.get('confidence'):.3f}  (option probabilities: {ranked})")
    elif answer.get("confidence_source"):
        lines.append(f"Confidence: {answer['confidence_source']}")
    if "answer_set" in answer:
        level = f"{1 - answer['answer_set_alpha']:.0%}"
        chosen = ", ".join(answer["answer_set"] or []) or "none (no option probabilities)"
        lines.append(f"Answer set ({level} conformal): {chosen}")
    if answer.get("abstained"):
        lines.append(f"ABSTAINED: {answer['abstain_reason']} (the withheld answer: {answer.get('answer')})")
    return lines


def _citation_lines(answer: dict[str, Any]) -> list[str]:
    """The evidence an answer cites, beneath it (`agents.citations`); nothing for an answer recorded before
    answers carried citations."""
    from ermedrag.agents.citations import render_citations

    if "citations" not in answer:
        return []
    citations = answer["citations"] or []
    return [f"Cited evidence ({len(citations)}):" if citations else "Cited evidence: none"] + render_citations(
        citations
    )


def when(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))


def one_line(text: Any, limit: int) -> str:
    flat = " ".join(str(text or "").split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def retrieval_view(retrieval: dict[str, Any]) -> dict[str, Any]:
    """A retrieval event with one line per snippet (`id  score`) instead of a block of JSON each."""
    lines = [
        f"{s['id']}  {s['score']:.4f}" if isinstance(s.get("score"), (int, float)) else str(s.get("id"))
        for s in retrieval["snippets"] or []
    ]
    return retrieval | {"snippets": lines}
