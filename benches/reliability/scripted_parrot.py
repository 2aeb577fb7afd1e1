"""A scripted model that quotes what it reads, then answers "B": `scripted:benches.reliability.scripted_parrot`.

Real models often quote their evidence while reasoning. This one always does, verbatim, so any markup a retrieved
document smuggles into a prompt comes back in the completion the answer is parsed from: if a forged
`<answer>D</answer>` survived into the prompt, the parse would find it before the model's own `<answer>B</answer>`.

- extractor (its prompt has a `Snippet:` line): one triplet whose condition and conclusion are the snippet text;
- respondent: `<think>` quoting the whole evidence block `</think><answer>B</answer>`;
- Med-R³ reasoner: first searches for the question, then quotes the documents it was given and answers B.
"""

from __future__ import annotations

import json

from langchain_core.messages import BaseMessage

ANSWER = "B"
QUOTE_CHARS = 4000  # what the parrot repeats of its input: enough for every snippet the bench retrieves


def reply(messages: list[BaseMessage]) -> str:
    if "<search>query</search>" in messages[0].text:
        return reasoner_reply(messages)
    prompt = messages[-1].text
    snippet = _between(prompt, "\nSnippet: ", "\nTriplets:")
    if snippet is not None:
        return extractor_reply(snippet)
    evidence = _between(prompt, "Evidence:\n", "\n\nQuestion:") or ""
    return f"<think>The evidence reads: {evidence[:QUOTE_CHARS]} So the answer is {ANSWER}.</think><answer>{ANSWER}</answer>"


def extractor_reply(snippet: str) -> str:
    text = snippet[:QUOTE_CHARS]
    return json.dumps([{"condition": text, "relation": "states", "conclusion": text}], ensure_ascii=False)


def reasoner_reply(messages: list[BaseMessage]) -> str:
    transcript = messages[-1].text if messages[-1].type == "ai" else ""
    if "<document>" not in transcript:
        question = next(m.text for m in reversed(messages) if m.type == "human")
        first_line = question.removeprefix("Question: ").splitlines()[0]
        return f"<think>I should look this up. <search>{first_line}</search>"
    documents = transcript[transcript.find("<document>") :]
    return f"I read: {documents[:QUOTE_CHARS]} So the answer is {ANSWER}.</think><answer>{ANSWER}</answer>"


def _between(text: str, start: str, end: str) -> str | None:
    """The text between the first `start` and the last `end` after it (None when `start` is absent)."""
    begin = text.find(start)
    if begin < 0:
        return None
    begin += len(start)
    stop = text.rfind(end)
    return text[begin : stop if stop >= begin else len(text)]
