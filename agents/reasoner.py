"""Med-R³ reasoner: thinks, may search mid-reasoning, then answers.

Output format (Med-R³'s public code): `<think> … <search>query</search>` — generation stops there, the
graph appends `<document>…</document>` with the results and lets the model continue — `… </think>`
then `<answer>…</answer>`. A model-written `<document>` is bad format (it would forge evidence); text
inside retrieved documents is neutralised so it can neither close the document nor inject an answer.
"""

from __future__ import annotations

import re
from typing import Literal, TypedDict

from ermedrag.agents.base import chat_messages, clip
from ermedrag.agents.respondent import Answer, format_options, parse_answer

SYSTEM_PROMPT = """You are a careful physician answering a medical question. Think step by step inside <think></think>. When you need medical knowledge you do not have, write a search query as <search>query</search> and stop; the search results will appear inside <document></document> and you continue thinking. Search at most a few times. Finally give only the answer inside <answer></answer>: the option letter for a multiple-choice question, otherwise a short answer."""

USER_TEMPLATE = """Question: {question}
{options}"""

EXAMPLE = (
    USER_TEMPLATE.format(question="Which vitamin deficiency causes rickets?",
                         options="Options:\nA. Vitamin C\nB. Vitamin D\nC. Vitamin K"),
    "<think>Rickets is a bone mineralisation disorder. <search>cause of rickets</search>\n<document>\n"
    "[ex-1] Rickets in children is caused by vitamin D deficiency.\n</document>\n"
    "The document says vitamin D deficiency causes rickets.</think><answer>B</answer>",
)

SEARCH_STOP = "</search>"
STOP = [SEARCH_STOP, "</answer>"]
MAX_QUERY_CHARS = 300
MAX_SEARCHES = 4  # per question, as in Med-R³: a further search ends the loop
STEP_MAX_NEW_TOKENS = 256  # one generation step: until a search closes or the answer ends
MAX_TOTAL_TOKENS = 1024  # the model's own tokens over all steps of one question (documents not counted)
TAG = re.compile(r"</?\s*(document|search|answer|think)\s*>", re.IGNORECASE)
SEARCH = re.compile(r"<search>(.*?)</search>\s*$", re.DOTALL | re.IGNORECASE)
DOCUMENT_BLOCK = re.compile(r"<document>.*?</document>", re.DOTALL | re.IGNORECASE)
# Exactly what `render_documents` inserts right after a closed search (a training rollout's transcript).
INSERTED_DOCUMENT = re.compile(r"(?<=</search>)\n<document>\n.*?\n</document>\n", re.DOTALL | re.IGNORECASE)


class Step(TypedDict):
    """One generation step. `query` is set when the step ended by closing a search."""

    query: str | None
    forged_document: bool
    answered: bool


def build_messages(question: str, options: dict[str, str] | None, transcript: str) -> list:
    """The conversation so far; a non-empty transcript is the assistant turn the model continues."""
    user = USER_TEMPLATE.format(question=clip(question), options=format_options(options)).rstrip()
    messages = chat_messages(SYSTEM_PROMPT, user, EXAMPLE)
    if transcript:
        from langchain_core.messages import AIMessage

        messages.append(AIMessage(content=transcript))
    return messages


def parse_step(segment: str) -> Step:
    """What one generated segment asks for. Never raises."""
    text = segment or ""
    query = SEARCH.search(text)
    cleaned = " ".join(query.group(1).split())[:MAX_QUERY_CHARS] if query else ""
    return Step(query=cleaned or None, forged_document="<document>" in text.lower(),
                answered="<answer>" in text.lower())


LoopAction = Literal["search", "no_search", "search_budget", "token_budget"]


def after_step(query: str | None, *, searches_done: int, generated_tokens: int, max_searches: int,
               max_total_tokens: int) -> LoopAction:
    """The one rule of the reason ↔ search loop (its graph and its training rollout): run the search the step
    closed while searches and tokens are left; otherwise say why the loop stops."""
    if not query:
        return "no_search"
    if searches_done >= max_searches:
        return "search_budget"
    if generated_tokens >= max_total_tokens:
        return "token_budget"
    return "search"


def neutralise(text: str) -> str:
    """Retrieved text with its tag-like sequences defused (`<answer>` → `‹answer›`)."""
    return TAG.sub(lambda m: "‹" + m.group(0)[1:-1] + "›", text)


def render_documents(snippets: list[dict]) -> str:
    body = "\n".join(f"[{s['id']}] {neutralise(clip(s['text'], 1500))}" for s in snippets) or "(no results)"
    return f"\n<document>\n{body}\n</document>\n"


def model_text(transcript: str) -> str:
    """The transcript without the documents the graph inserted: what the model itself wrote."""
    return DOCUMENT_BLOCK.sub(" ", transcript)


def parse_final(transcript: str, options: dict[str, str] | None) -> Answer:
    """The answer, read only from what the model wrote (never from retrieved documents)."""
    return parse_answer(model_text(transcript), options)
