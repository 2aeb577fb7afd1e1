"""Parsers on adversarial text up to 1 MB: each must return within 50 ms (best of 3) and never raise.

One case per parser, over every input below; the detail names the slowest input. Parsers read untrusted text
(model output, documents, rollouts), so they must be linear and bounded whatever they are given.
"""

from __future__ import annotations

import functools
import json
import random
import time
from typing import Any, Callable

from benches.reliability.harness import Verdict, Workspace, crash, error_text, hang, ok, register

MB = 1_000_000
LIMIT_S = 0.050
OPTIONS = {"A": "Metformin", "B": "Insulin", "C": "Glipizide", "D": "Pioglitazone"}
TRIPLETS = [{"condition": "type 2 diabetes", "relation": "treated by", "conclusion": "metformin", "snippet_id": "d1#0-9"}]


def _random_unicode(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    alphabet = "<>/|[]{}\"':\\ \n\tabcAB\u200b\uff1c\uff1e\u2039\u203a\u00a0\u0000éЖ中😀"
    return "".join(rng.choice(alphabet) for _ in range(n))


@functools.cache
def adversarial_inputs() -> dict[str, str]:
    """Name → text; all but the small ones are about 1 MB (built once)."""
    json_triplets = json.dumps([{"condition": "a", "relation": "b", "conclusion": "c"}] * 25_000)
    return {
        "empty": "",
        "well_formed": "<think>Metformin first.</think><answer>A</answer>",
        "open_angles": "<" * MB,
        "answer_opens": "<answer>" * (MB // 8),
        "answer_pairs": "<answer>A</answer>" * (MB // 18),
        "answer_closes": "</answer>" * (MB // 9),
        "think_unclosed": "<think>" + "x" * MB,
        "think_pairs": "<think></think>" * (MB // 15),
        "search_opens": "<search>" * (MB // 8),
        "search_opens_then_closes": "<search>" * (MB // 16) + "</search>" * (MB // 18),
        "search_pairs_in_think": "<think>" + "<search>q</search>" * (MB // 17) + "</think>",
        "document_tags": "<document>" * (MB // 10),
        "square_brackets": "[" * MB,
        "braces": "{" * MB,
        "nested_json_opens": '[{"condition": ' * (MB // 15),
        "field_value_opens": '"condition": "' * (MB // 15),
        "json_triplets": json_triplets[:MB],
        "json_triplets_cut": json_triplets[: MB // 2 - 7],
        "pipe_lines": "a | b | c\n" * (MB // 10),
        "answer_is_lines": "The answer is " * (MB // 14),
        "fullwidth_tags": "＜ａｎｓｗｅｒ＞" * (MB // 8),
        "zero_width_in_tags": "<\u200b/\u200ba\u200b>" * (MB // 7),
        "pipe_tokens": "<|" * (MB // 2),
        "angle_spaces": "< " * (MB // 2),
        "long_tag_names": ("<" + "a" * 79) * (MB // 80),
        "invisible_run": "<" + "\u200b" * MB + ">",
        "nul_bytes": "\x00" * MB,
        "lone_surrogates": "\ud800" * 1000 + "<answer>\udfff</answer>" + "\udc80" * 1000,
        "random_unicode": _random_unicode(MB),
    }


def _parsers() -> dict[str, Callable[[str], Any]]:
    from ermedrag.agents import markup, reasoner
    from ermedrag.agents.extractor import parse_triplets
    from ermedrag.agents.respondent import parse_answer
    from ermedrag.training import answer_rewards, search_rewards

    hit_kwargs = {"gold_evidence": [["d1", "d2"]]}
    return {
        "respondent.parse_answer": lambda t: parse_answer(t, OPTIONS),
        "respondent.parse_answer_free_text": lambda t: parse_answer(t, None),
        "extractor.parse_triplets": lambda t: parse_triplets(t, "snippet-1"),
        "reasoner.parse_step": reasoner.parse_step,
        "reasoner.parse_final": lambda t: reasoner.parse_final(
            [{"kind": "model", "text": t}, {"kind": "document", "text": t}, {"kind": "model", "text": t}], OPTIONS),
        "markup.defuse": markup.defuse,
        "markup.quote": lambda t: markup.quote(t, 1500),
        "answer_rewards.correctness_reward": lambda t: answer_rewards.correctness_reward(
            [t], gold=["A"], options=[OPTIONS]),
        "answer_rewards.well_formed_correctness_reward": lambda t: answer_rewards.well_formed_correctness_reward(
            [[{"role": "assistant", "content": t}]], gold=["A"], options=[OPTIONS]),
        "answer_rewards.format_reward": lambda t: answer_rewards.format_reward([t]),
        "answer_rewards.length_penalty": lambda t: answer_rewards.length_penalty([t]),
        "answer_rewards.evidence_use_reward": lambda t: answer_rewards.evidence_use_reward(
            [t], gold=["A"], options=[OPTIONS], triplets=[TRIPLETS]),
        "search_rewards.audit_searches": search_rewards.audit_searches,
        "search_rewards.search_format_reward": lambda t: search_rewards.search_format_reward([t]),
        "search_rewards.retrieval_hit_reward": lambda t: search_rewards.retrieval_hit_reward([t], **hit_kwargs),
        "search_rewards.med_r3_penalties": lambda t: search_rewards.med_r3_penalties([t]),
    }


def _best_of_3(parse: Callable[[str], Any], text: str) -> float:
    """Seconds of the fastest of up to 3 calls. Repeated only when near the limit: a fast call is fast, and one
    ten times over the limit is not noise."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        parse(text)
        best = min(best, time.perf_counter() - started)
        if best <= LIMIT_S or best > 10 * LIMIT_S:
            break
    return best


def check_parser(name: str) -> Verdict:
    parse = _parsers()[name]
    inputs = adversarial_inputs()
    slow: list[str] = []
    slowest = ("", 0.0)
    for label, text in inputs.items():
        try:
            seconds = _best_of_3(parse, text)
        except Exception as err:  # noqa: BLE001 - a parser that raises is the finding
            return crash(f"raised on {label!r} ({len(text):,} chars): {error_text(err)}")
        if seconds > slowest[1]:
            slowest = (label, seconds)
        if seconds > LIMIT_S:
            slow.append(f"{label} {seconds * 1000:.0f} ms")
    if slow:
        return hang(f"over {LIMIT_S * 1000:.0f} ms (best of 3) on {len(slow)} of {len(inputs)} inputs: "
                    + ", ".join(slow))
    return ok(f"{len(inputs)} inputs up to 1 MB, none raised; slowest {slowest[0]} {slowest[1] * 1000:.1f} ms")


def _register(name: str) -> None:
    @register(f"parser_{name}", "parsers", "returns within 50 ms (best of 3) on every adversarial input up to 1 MB, "
              "never raises", quick=True, timeout_s=120)
    def run(workspace: Workspace) -> Verdict:
        return check_parser(name)


for _name in ("respondent.parse_answer", "respondent.parse_answer_free_text", "extractor.parse_triplets",
              "reasoner.parse_step", "reasoner.parse_final", "markup.defuse", "markup.quote",
              "answer_rewards.correctness_reward", "answer_rewards.well_formed_correctness_reward",
              "answer_rewards.format_reward", "answer_rewards.length_penalty", "answer_rewards.evidence_use_reward",
              "search_rewards.audit_searches", "search_rewards.search_format_reward",
              "search_rewards.retrieval_hit_reward", "search_rewards.med_r3_penalties"):
    _register(_name)
