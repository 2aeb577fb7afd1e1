"""The respondent's worked example, rewritten: the variants the learning benches compare (`citation_example.py`
side by side on the base model, `learning_signal.py --grpo-example` as a GRPO arm).

A recorded respondent prompt is [system, example question, example reply, question]; a variant replaces the
example's evidence and reasoning and nothing else. The product's example (`agents.respondent`) is `current`.
"""

from __future__ import annotations

from typing import Callable

from ermedrag.agents import respondent

Messages = list[dict[str, str]]

TWO_LINES = (
    "1. [ex-1] vitamin C deficiency — causes — scurvy\n2. [ex-2] vitamin D deficiency in children — causes — rickets"
)


def swapped(prompt: Messages, user_old: str, user_new: str, reply_old: str, reply_new: str) -> Messages:
    """The prompt with its worked example's evidence and reasoning replaced (system, example user, example
    assistant, question), refusing a prompt whose example is not the one this module knows."""
    system, user, reply, *question = prompt
    if user_old not in user["content"] or reply_old not in reply["content"]:
        raise ValueError(f"a recorded prompt's worked example is not agents.respondent's: {reply['content'][:120]!r}")
    return [
        system,
        {**user, "content": user["content"].replace(user_old, user_new)},
        {**reply, "content": reply["content"].replace(reply_old, reply_new)},
        *question,
    ]


EXAMPLES: dict[str, Callable[[Messages], Messages]] = {
    # "The evidence says vitamin D deficiency ...": the prompts as recorded
    "current": lambda prompt: prompt,
    # the same example citing its evidence line by number
    "cites_number": lambda prompt: swapped(
        prompt,
        respondent.EXAMPLE_EVIDENCE,
        respondent.EXAMPLE_EVIDENCE,
        respondent.EXAMPLE_REASONING,
        respondent.EXAMPLE_REASONING.replace("The evidence says", "Evidence 1 says"),
    ),
    # two evidence lines, citing the relevant second one by number and setting the first aside
    "cites_among_two": lambda prompt: swapped(
        prompt,
        respondent.EXAMPLE_EVIDENCE,
        TWO_LINES,
        respondent.EXAMPLE_REASONING,
        "Evidence 2 says vitamin D deficiency causes rickets, which fits bowed legs; evidence 1, on scurvy, does not",
    ),
}
