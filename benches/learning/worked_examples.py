"""The respondent's worked example, rewritten: the variants the learning benches compare (`citation_example.py`
side by side on the base model, `learning_signal.py --grpo-example` as a GRPO arm).

A recorded respondent prompt is [system, example question, example reply, question]; a variant replaces the
example's evidence and reasoning and nothing else. The product's example (`agents.respondent`) is `current`.
"""

from __future__ import annotations

from typing import Callable

from ermedrag.agents import respondent

Messages = list[dict[str, str]]

# The example's reasoning in the prompts recorded for the benches (respondent prompts version 1), and in the
# product's prompts since version 2 (citing its line as "Evidence [1]"): a variant rewrites either.
RECORDED_REASONING = "The evidence says vitamin D deficiency causes rickets, which fits bowed legs"
KNOWN_REASONINGS = (RECORDED_REASONING, respondent.EXAMPLE_REASONING)
TWO_LINES = (
    "1. [ex-1] vitamin C deficiency — causes — scurvy\n2. [ex-2] vitamin D deficiency in children — causes — rickets"
)


def swapped(prompt: Messages, user_old: str, user_new: str, reply_new: str) -> Messages:
    """The prompt with its worked example's evidence and reasoning replaced (system, example user, example
    assistant, question), refusing a prompt whose example is not one this module knows (`KNOWN_REASONINGS`)."""
    system, user, reply, *question = prompt
    reply_old = next((known for known in KNOWN_REASONINGS if known in reply["content"]), None)
    if user_old not in user["content"] or reply_old is None:
        raise ValueError(f"a recorded prompt's worked example is not agents.respondent's: {reply['content'][:120]!r}")
    return [
        system,
        {**user, "content": user["content"].replace(user_old, user_new)},
        {**reply, "content": reply["content"].replace(reply_old, reply_new)},
        *question,
    ]


EXAMPLES: dict[str, Callable[[Messages], Messages]] = {
    # the prompts as recorded ("The evidence says vitamin D deficiency ..." in version 1)
    "current": lambda prompt: prompt,
    # the same example citing its evidence line by number
    "cites_number": lambda prompt: swapped(
        prompt,
        respondent.EXAMPLE_EVIDENCE,
        respondent.EXAMPLE_EVIDENCE,
        RECORDED_REASONING.replace("The evidence says", "Evidence 1 says"),
    ),
    # two evidence lines, citing the relevant second one by number and setting the first aside
    "cites_among_two": lambda prompt: swapped(
        prompt,
        respondent.EXAMPLE_EVIDENCE,
        TWO_LINES,
        "Evidence 2 says vitamin D deficiency causes rickets, which fits bowed legs; evidence 1, on scurvy, does not",
    ),
}
