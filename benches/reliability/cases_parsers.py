"""Parsers on adversarial text up to 1 MB: each must be linear (see `linear_time`) and never raise.

One case per parser, over every input below; the detail names the slowest input. Parsers read untrusted text
(model output, documents, rollouts), so they must be linear and bounded whatever they are given.
"""

from __future__ import annotations

import functools
import json
import random
from typing import Any, Callable

from benches.reliability.harness import Verdict, Workspace, crash, error_text, hang, ok, register
from benches.reliability.linear_time import limits_text, superlinear

MB = 1_000_000
OPTIONS = {"A": "Metformin", "B": "Insulin", "C": "Glipizide", "D": "Pioglitazone"}
TRIPLETS = [
    {"condition": "type 2 diabetes", "relation": "treated by", "conclusion": "metformin", "snippet_id": "d1#0-9"}
]


def _random_unicode(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    alphabet = "<>/|[]{}\"':\\ \n\tabcAB\u200b\uff1c\uff1e\u2039\u203a\u00a0\u0000éЖ中😀"
    return "".join(rng.choice(alphabet) for _ in range(n))


@functools.cache
def adversarial_inputs(size: int = MB) -> dict[str, str]:
    """Name → text that makes naive parsers backtrack or rescan; all but the small ones about `size` characters
    (built once per size). The one list every linear-time check uses: the bench's cases and tests/test_parsers."""

    def fill(unit: str) -> str:
        return (unit * (size // len(unit) + 1))[:size]

    json_triplets = json.dumps([{"condition": "a", "relation": "b", "conclusion": "c"}] * (size // 40))
    return {
        "empty": "",
        "well_formed": "<think>Metformin first.</think><answer>A</answer>",
        "open_angles": "<" * size,
        "answer_opens": "<answer>" * (size // 8),
        "answer_pairs": "<answer>A</answer>" * (size // 18),
        "answer_closes": "</answer>" * (size // 9),
        "think_unclosed": "<think>" + "x" * size,
        "think_opens": fill("<think>"),
        "think_then_answer": fill("<think>x<answer>"),
        "think_pairs": "<think></think>" * (size // 15),
        "search_opens": "<search>" * (size // 8),
        "search_opens_then_closes": "<search>" * (size // 16) + "</search>" * (size // 18),
        "search_pairs_in_think": "<think>" + "<search>q</search>" * (size // 17) + "</think>",
        "document_tags": "<document>" * (size // 10),
        "document_pairs": fill("<document>x</document>"),
        "short_tags": fill("<a>"),
        "spaced_tags": fill("< / a >"),
        "square_brackets": "[" * size,
        "braces": "{" * size,
        "brackets_alternating": fill("[{"),
        "brackets_then_braces": "[" * (size // 2) + "{" * (size // 2),
        "nested_1000": fill("[" * 1000 + "{" * 1000),
        # Unclosed deep JSON: its nesting passes the parser's limit within the first unit and keeps growing.
        "deep_json": fill('[{"a":' * 900 + "x" * 10_000),
        "deeper_json": fill('[{"a":[' * 1200 + "x" * 10_000),
        "nested_json_opens": '[{"condition": ' * (size // 15),
        "field_value_opens": '"condition": "' * (size // 15),
        "long_field_values": fill('"condition": "' + "x" * 420),
        "json_triplets": json_triplets[:size],
        "json_triplets_cut": json_triplets[: size // 2 - 7],
        "json_long_strings": fill('["' + "a" * 5000 + '", '),
        "json_dicts": fill('[{"a": 1}, '),
        "pipes": fill("|"),
        "pipe_lines": "a | b | c\n" * (size // 10),
        "pipe_lines_unspaced": fill("a|b|\n"),
        "four_part_lines": fill("a | b | c | d\n"),
        "newlines": "\n" * size,
        "answer_is_lines": "The answer is " * (size // 14),
        "answer_then_spaces": "answer" + " " * size,
        "answer_colon_newlines": "answer:" + "\n" * size,
        "letters": fill("abcdefghij"),
        "fullwidth_tags": "＜ａｎｓｗｅｒ＞" * (size // 8),
        "fullwidth_brackets": fill("\uff1canswer\uff1e"),
        "dotted_capital_i": fill("\u0130<ANSWER>"),
        "zero_width_in_tags": "<\u200b/\u200ba\u200b>" * (size // 7),
        "zero_width_around_tags": fill("<\u200banswer\u200b>\u200b"),
        "pipe_tokens": "<|" * (size // 2),
        "control_tokens": fill("<|im_start|>"),
        "angle_spaces": "< " * (size // 2),
        "long_tag_names": ("<" + "a" * 79) * (size // 80),
        "mixed": fill('<answer>[{"condition": "x|y|z\n\u200b'),
        "invisible_run": "<" + "\u200b" * size + ">",
        "nul_bytes": "\x00" * size,
        "lone_surrogates": "\ud800" * 1000 + "<answer>\udfff</answer>" + "\udc80" * 1000,
        "random_unicode": _random_unicode(size),
    }


def _parsers() -> dict[str, Callable[[str], Any]]:
    from ermedrag.agents import markup, reasoner
    from ermedrag.agents.extractor import closed_list, parse_triplets
    from ermedrag.agents.respondent import normalise_answer, parse_answer
    from ermedrag.training.rewards import answers as answer_rewards, search as search_rewards

    hit_kwargs = {"gold_evidence": [["d1", "d2"]]}
    return {
        "respondent.parse_answer": lambda t: parse_answer(t, OPTIONS),
        "respondent.parse_answer_free_text": lambda t: parse_answer(t, None),
        "respondent.normalise_answer": lambda t: normalise_answer(t, OPTIONS),
        "extractor.parse_triplets": lambda t: parse_triplets(t, "snippet-1"),
        "extractor.closed_list": closed_list,
        "reasoner.parse_step": reasoner.parse_step,
        "reasoner.parse_final": lambda t: reasoner.parse_final(
            [{"kind": "model", "text": t}, {"kind": "document", "text": t}, {"kind": "model", "text": t}], OPTIONS
        ),
        "markup.defuse": markup.defuse,
        "markup.quote": lambda t: markup.quote(t, 1500),
        "answer_rewards.correctness_reward": lambda t: answer_rewards.correctness_reward(
            [t], gold=["A"], options=[OPTIONS]
        ),
        "answer_rewards.well_formed_correctness_reward": lambda t: answer_rewards.well_formed_correctness_reward(
            [[{"role": "assistant", "content": t}]], gold=["A"], options=[OPTIONS]
        ),
        "answer_rewards.format_reward": lambda t: answer_rewards.format_reward([t]),
        "answer_rewards.length_penalty": lambda t: answer_rewards.length_penalty([t]),
        "answer_rewards.evidence_use_reward": lambda t: answer_rewards.evidence_use_reward(
            [t], gold=["A"], options=[OPTIONS], triplets=[TRIPLETS]
        ),
        "search_rewards.audit_searches": search_rewards.audit_searches,
        "search_rewards.search_format_reward": lambda t: search_rewards.search_format_reward([t]),
        "search_rewards.retrieval_hit_reward": lambda t: search_rewards.retrieval_hit_reward([t], **hit_kwargs),
        "search_rewards.med_r3_penalties": lambda t: search_rewards.med_r3_penalties([t]),
    }


def check_parser(name: str) -> Verdict:
    parse = _parsers()[name]
    wholes, quarters = adversarial_inputs(MB), adversarial_inputs(MB // 4)
    slow: list[str] = []
    slowest = ("", 0.0)
    for label, text in wholes.items():
        try:
            why, seconds = superlinear(parse, quarters[label], text)
        except Exception as err:  # noqa: BLE001 - a parser that raises is the finding
            return crash(f"raised on {label!r} ({len(text):,} chars): {error_text(err)}")
        if seconds > slowest[1]:
            slowest = (label, seconds)
        if why:
            slow.append(f"{label}: {why}")
    if slow:
        return hang(f"not linear ({limits_text()}) on {len(slow)} of {len(wholes)} inputs: " + ", ".join(slow))
    return ok(
        f"{len(wholes)} inputs up to 1 MB, none raised, all linear; slowest {slowest[0]} "
        f"{slowest[1] * 1000:.1f} ms of CPU"
    )


def _register(name: str) -> None:
    @register(
        f"parser_{name}",
        "parsers",
        f"linear on every adversarial input up to 1 MB ({limits_text()}), never raises",
        quick=True,
        timeout_s=120,
    )
    def run(workspace: Workspace) -> Verdict:
        return check_parser(name)


for _name in _parsers():
    _register(_name)
