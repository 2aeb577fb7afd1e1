"""Respondent: question, options and evidence triplets → reasoning in <think> and the answer in <answer>.

`parse_answer` reads only the model's completion (never the prompt, whose example answer would otherwise
be taken for the model's), never raises, and says whether the format was strictly followed.
"""

from __future__ import annotations

import re
from typing import TypedDict

from ermedrag.agents.base import chat_messages, clip
from ermedrag.agents.extractor import NO_EVIDENCE

SYSTEM_PROMPT = """You are a careful physician answering a medical question. Use the evidence triplets when they are relevant and ignore those that are not.
First reason briefly inside <think></think>, then give only the final answer inside <answer></answer>: the option letter for a multiple-choice question, otherwise a short answer."""

USER_TEMPLATE = """Evidence:
{evidence}

Question: {question}
{options}"""

EXAMPLE = (
    USER_TEMPLATE.format(
        evidence="1. [ex-1] vitamin D deficiency in children — causes — rickets",
        question="A toddler with bowed legs and poor bone mineralisation most likely lacks which vitamin?",
        options="Options:\nA. Vitamin C\nB. Vitamin D\nC. Vitamin B12",
    ),
    "<think>The evidence says vitamin D deficiency causes rickets, which fits bowed legs: option B.</think>"
    "<answer>B</answer>",
)

MAX_PARSE_CHARS = 20_000
MAX_ANSWER_CHARS = 500

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
UNCLOSED_ANSWER = re.compile(r"<answer>(.*)$", re.DOTALL | re.IGNORECASE)  # generation stopped at </answer>
STOP = ["</answer>"]
THINK_TAG = re.compile(r"<think>(.*?)</think>", re.DOTALL | re.IGNORECASE)
LENIENT_ANSWER = re.compile(r"(?:final answer|answer)\s*(?:is|:)\s*\(?([^\n]+)", re.IGNORECASE)


class Answer(TypedDict):
    """Parsed respondent output. `answer` is an option letter when options were given (else free text)."""

    answer: str | None
    reasoning: str
    ok: bool
    well_formed: bool
    error: str | None


def format_options(options: dict[str, str] | None) -> str:
    if not options:
        return ""
    return "Options:\n" + "\n".join(f"{key}. {clip(str(text), 1000)}" for key, text in options.items())


def build_messages(question: str, options: dict[str, str] | None, evidence: str) -> list:
    """`evidence` is rendered by the caller: triplets (ER-MedRAG), raw snippets (vanilla RAG) or none (CoT)."""
    user = USER_TEMPLATE.format(evidence=evidence, question=clip(question), options=format_options(options))
    return chat_messages(SYSTEM_PROMPT, user.rstrip(), EXAMPLE)


def render_snippets(snippets: list[dict]) -> str:
    """Raw retrieved text as evidence, MedRAG-style (the vanilla RAG baseline)."""
    if not snippets:
        return NO_EVIDENCE
    return "\n".join(f"{i}. [{s['id']}] {s.get('title', '')}: {clip(s['text'], 1500)}" for i, s in enumerate(snippets, 1))


def parse_answer(completion: str, options: dict[str, str] | None = None) -> Answer:
    text = (completion or "")[:MAX_PARSE_CHARS]
    tags = ANSWER_TAG.findall(text)
    think = THINK_TAG.search(text)
    reasoning = (think.group(1) if think else text.split("<answer>")[0]).strip()[:MAX_PARSE_CHARS]
    well_formed = bool(think) and len(tags) == 1 and not text[text.lower().rfind("</answer>") + 9:].strip()
    unclosed = None if tags else UNCLOSED_ANSWER.search(text)
    if tags or unclosed:
        raw = tags[0] if tags else unclosed.group(1)
    else:
        lenient = LENIENT_ANSWER.search(text)
        if not lenient:
            return Answer(answer=None, reasoning=reasoning, ok=False, well_formed=False,
                          error="no <answer> tag" if text.strip() else "empty completion")
        raw = lenient.group(1)
    answer = normalise_answer(raw, options)
    if answer is None:
        return Answer(answer=None, reasoning=reasoning, ok=False, well_formed=False,
                      error=f"answer {raw.strip()[:80]!r} matches no option")
    return Answer(answer=answer, reasoning=reasoning, ok=True, well_formed=well_formed, error=None)


def normalise_answer(raw: str, options: dict[str, str] | None) -> str | None:
    """Map a raw answer to an option key ("B", "(b)", "B. text", or the option's own text), or tidy free text."""
    text = " ".join(raw.split())[:MAX_ANSWER_CHARS].strip(" .:)(*\"'")
    if not options:
        return text or None
    keys = {str(k).upper(): str(k) for k in options}
    letter = re.match(r"^\(?([A-Za-z])\)?(?:$|[\s.:)\-])", text)
    if letter and letter.group(1).upper() in keys:
        return keys[letter.group(1).upper()]
    lowered = text.lower()
    for key, option in options.items():
        if lowered == str(option).strip(" .").lower():
            return str(key)
    for key, option in options.items():
        option_text = str(option).strip(" .").lower()
        if option_text and re.match(rf"^{re.escape(option_text)}\b", lowered):
            return str(key)
    return None
