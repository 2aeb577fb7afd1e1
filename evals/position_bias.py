"""Position bias: the same question with its options in other orders (`ermedrag eval --permute-options N`).

Order 0 is the question as given. Order i moves every option's text i letters up, wrapping around, over the same
letter keys: with options A-D, order 1 shows B's text at A, C's at B, D's at C and A's at D. The model's letter is
mapped back to the option text it stood for, so a row's `answer`, `gold` and `correct` are always in the original
keys and compare across orders. Rows also keep where things stood in the order the model saw: `answer_position`
(the letter it chose) and `gold_position` (the letter the gold text stood at).

A question is asked in at most one order per option (order n of n options is order 0 again), and once when it has
no options.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any, Iterable, Mapping, Sequence

from ermedrag.evals.metrics import wilson_interval


# ------------------------------------------------------------------------------------------- the orders


def option_orders(options: Mapping[str, str] | None, permute: int) -> int:
    """How many orders a question is asked in: `permute`, at most one per option, 1 without options."""
    if not options or permute <= 1:
        return 1
    return min(permute, len(options))


def rotate_options(options: Mapping[str, str], order: int) -> dict[str, str]:
    """The options as order `order` shows them: the same keys, each holding the text `order` keys further on."""
    keys = list(options)
    return {key: options[keys[(j + order) % len(keys)]] for j, key in enumerate(keys)}


def shown_key(keys: Sequence[str], original: str | None, order: int) -> str | None:
    """Where the option `original` stands in order `order` (None when it is no option)."""
    if original not in keys:
        return None
    return keys[(keys.index(original) - order) % len(keys)]


def original_key(keys: Sequence[str], shown: str | None, order: int) -> str | None:
    """The original key of the option shown at `shown` in order `order` (None when `shown` is no option)."""
    if shown not in keys:
        return None
    return keys[(keys.index(shown) + order) % len(keys)]


# ------------------------------------------------------------------------------------------- the summary


def position_bias_summary(rows: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]] | None:
    """Per configuration (`config_key`) that was asked in several orders: accuracy per order, consistency,
    and where its answers stood against where the gold stood. None when no row has an order > 0."""
    by_config: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for row in rows:
        by_config[str(row.get("config_key"))].append(row)
    permuted = {key: group for key, group in by_config.items() if any((r.get("order") or 0) > 0 for r in group)}
    if not permuted:
        return None
    return {key: _config_summary(group) for key, group in sorted(permuted.items())}


def _config_summary(rows: list[Mapping[str, Any]]) -> dict[str, Any]:
    config = rows[0].get("config") or {}
    return {
        "system": config.get("system"),
        "model": config.get("model"),
        "orders": max(_orders(r) for r in rows),
        "by_order": _accuracy_by_order(rows),
        "consistency": _consistency(rows),
        "positions": _positions(rows),
    }


def _orders(row: Mapping[str, Any]) -> int:
    """The orders the row's question was asked in (rows name it; an older row, its own order + 1)."""
    return int(row.get("orders") or (row.get("order") or 0) + 1)


def _accuracy_by_order(rows: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    counts: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for row in rows:
        tally = counts[int(row.get("order") or 0)]
        tally[0] += bool(row.get("correct"))
        tally[1] += 1
    return [
        {"order": order, "n": n, "correct": correct, "accuracy": correct / n, "ci95": list(wilson_interval(correct, n))}
        for order, (correct, n) in sorted(counts.items())
    ]


def _consistency(rows: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Questions (per sample) answered in every one of their orders, and how many of them chose the same option
    text in all of them (an unparsed answer matches nothing)."""
    answers: dict[tuple[Any, Any, Any], dict[int, Any]] = defaultdict(dict)
    wanted: dict[tuple[Any, Any, Any], int] = {}
    for row in rows:
        unit = (row.get("benchmark"), row.get("question_id"), row.get("sample", 0))
        answers[unit][int(row.get("order") or 0)] = row.get("answer")
        wanted[unit] = max(wanted.get(unit, 1), _orders(row))
    complete = [
        by_order for unit, by_order in answers.items() if wanted[unit] > 1 and set(by_order) >= set(range(wanted[unit]))
    ]
    consistent = sum(1 for by_order in complete if None not in by_order.values() and len(set(by_order.values())) == 1)
    return {
        "questions": len(complete),
        "consistent": consistent,
        "rate": consistent / len(complete) if complete else None,
    }


def _positions(rows: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Counts per letter of the positions chosen and of where the gold stood, over the rows with a parsed
    answer, their total variation distance, and accuracy by where the gold stood (over all rows)."""
    answered = [r for r in rows if r.get("answer_position") is not None and r.get("gold_position") is not None]
    chosen = Counter(str(r["answer_position"]) for r in answered)
    gold = Counter(str(r["gold_position"]) for r in answered)
    letters = sorted(set(chosen) | set(gold) | {str(r["gold_position"]) for r in rows if r.get("gold_position")})
    n = len(answered)
    distance = 0.5 * sum(abs(chosen[k] - gold[k]) for k in letters) / n if n else None
    by_gold: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for row in rows:
        if row.get("gold_position") is not None:
            tally = by_gold[str(row["gold_position"])]
            tally[0] += bool(row.get("correct"))
            tally[1] += 1
    return {
        "letters": letters,
        "n": n,
        "unanswered": len(rows) - n,
        "chosen": {k: chosen[k] for k in letters},
        "gold": {k: gold[k] for k in letters},
        "total_variation": distance,
        "accuracy_by_gold_position": {k: {"n": t[1], "accuracy": t[0] / t[1]} for k, t in sorted(by_gold.items())},
    }


# ------------------------------------------------------------------------------------------- markdown


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}"


def _accuracy_cell(entry: Mapping[str, Any]) -> str:
    low, high = entry["ci95"]
    return f"{_pct(entry['accuracy'])} [{100 * low:.0f}–{100 * high:.0f}] (n={entry['n']})"


def position_bias_section(rows: Iterable[Mapping[str, Any]]) -> str:
    """The report's "Position bias" section (markdown), or "" when no question was asked in another order."""
    summary = position_bias_summary(rows)
    if summary is None:
        return ""
    orders = max(s["orders"] for s in summary.values())
    lines = [
        "",
        "## Position bias",
        "",
        "Each question was also asked with its options in other orders (`--permute-options`): order i moves "
        "every option's text i letters up, wrapping around, over the same letters. Answers are mapped back to "
        "the option text before scoring, so accuracy compares across orders. Accuracy % per order (Wilson 95% "
        "interval, n answers); consistency: the share of questions whose chosen option text is the same in every "
        "order they were asked in (questions answered in all of them; an unparsed answer is never consistent).",
        "",
        "| system | model | "
        + " | ".join(f"order {i}" for i in range(orders))
        + " | consistency | TV distance chosen vs gold position |",
        "|---|---|" + "---|" * (orders + 2),
    ]
    for s in summary.values():
        by_order = {entry["order"]: entry for entry in s["by_order"]}
        cells = [_accuracy_cell(by_order[i]) if i in by_order else "–" for i in range(orders)]
        consistency = s["consistency"]
        distance = s["positions"]["total_variation"]
        lines.append(
            f"| {s['system']} | {s['model']} | "
            + " | ".join(cells)
            + f" | {_pct(consistency['rate'])} (n={consistency['questions']}) | "
            + ("–" if distance is None else f"{distance:.3f}")
            + " |"
        )
    lines += [
        "",
        "Letter positions the model chose against those where the gold option stood (answers it gave, all "
        "orders), and accuracy by where the gold stood:",
        "",
        "| system | model | position | chosen | gold | accuracy when gold here |",
        "|---|---|---|---|---|---|",
    ]
    for s in summary.values():
        positions = s["positions"]
        for letter in positions["letters"]:
            by_gold = positions["accuracy_by_gold_position"].get(letter)
            accuracy = f"{_pct(by_gold['accuracy'])} (n={by_gold['n']})" if by_gold else "–"
            lines.append(
                f"| {s['system']} | {s['model']} | {letter} | {positions['chosen'][letter]} | "
                f"{positions['gold'][letter]} | {accuracy} |"
            )
    lines += [
        "",
        "What this shows: whether accuracy depends on where the right option stands, whether a system keeps "
        "its answer when only the order changes, and which letters it prefers beyond where the gold stood "
        "(total variation distance: 0 = it picks each letter as often as the gold stands there, 1 = the letters it "
        "picks and those where the gold stood never overlap). "
        "What it cannot show: only cyclic shifts are asked (N of the n! orders; an option keeps its neighbours), "
        "so a bias tied to which options stand together goes unseen; at temperature > 0 an inconsistent answer "
        "may be sampling noise rather than position bias (compare answer entropy from `--samples`); with fewer "
        "orders than options the gold does not stand equally often at every letter; and differences between "
        "orders inside their intervals, or over few questions, are noise.",
    ]
    return "\n".join(lines) + "\n"
