"""The respondent's worked example, rewritten: the variants the learning benches compare (`citation_example.py`
side by side on the base model, `learning_signal.py --grpo-example` as a GRPO arm).

A recorded respondent prompt is [system, example question, example reply, question]; a variant replaces the
example's evidence and reasoning and nothing else. The product's example (`agents.respondent`) is `current`.
"""

from __future__ import annotations

from typing import Callable

from ermedrag.agents import respondent

Messages = list[dict[str, str]]

# The example's reasoning and evidence in the prompts recorded for the benches (respondent prompts version 1), its
# reasoning in versions 2 (citing its line as "Evidence [1]") and 3 (the product's now, whose evidence line links
# its option: `respondent.linked_triplets`): a variant rewrites any of them.
RECORDED_REASONING = "The evidence says vitamin D deficiency causes rickets, which fits bowed legs"
RECORDED_EVIDENCE = "1. [ex-1] vitamin D deficiency in children — causes — rickets"
VERSION_2_REASONING = "Evidence [1] says vitamin D deficiency causes rickets, which fits bowed legs"
KNOWN_REASONINGS = (RECORDED_REASONING, VERSION_2_REASONING, respondent.EXAMPLE_REASONING)
TWO_LINES = (
    "1. [ex-1] vitamin C deficiency — causes — scurvy\n2. [ex-2] vitamin D deficiency in children — causes — rickets"
)
EVIDENCE_PREFIX, QUESTION_PREFIX = "Evidence:\n", "\n\nQuestion: "


def swapped(prompt: Messages, evidence_new: str, reply_new: str) -> Messages:
    """The prompt with its worked example's evidence block and reasoning replaced (system, example user, example
    assistant, question), refusing a prompt whose example is not one this module knows (`KNOWN_REASONINGS`)."""
    system, user, reply, *question = prompt
    reply_old = next((known for known in KNOWN_REASONINGS if known in reply["content"]), None)
    content = user["content"]
    end = content.find(QUESTION_PREFIX)
    if not content.startswith(EVIDENCE_PREFIX) or end < 0 or reply_old is None:
        raise ValueError(f"a recorded prompt's worked example is not agents.respondent's: {reply['content'][:120]!r}")
    return [
        system,
        {**user, "content": EVIDENCE_PREFIX + evidence_new + content[end:]},
        {**reply, "content": reply["content"].replace(reply_old, reply_new)},
        *question,
    ]


EXAMPLES: dict[str, Callable[[Messages], Messages]] = {
    # the prompts as recorded ("The evidence says vitamin D deficiency ..." in version 1)
    "current": lambda prompt: prompt,
    # the same example citing its evidence line by number
    "cites_number": lambda prompt: swapped(
        prompt, RECORDED_EVIDENCE, RECORDED_REASONING.replace("The evidence says", "Evidence 1 says")
    ),
    # two evidence lines, citing the relevant second one by number and setting the first aside
    "cites_among_two": lambda prompt: swapped(
        prompt,
        TWO_LINES,
        "Evidence 2 says vitamin D deficiency causes rickets, which fits bowed legs; evidence 1, on scurvy, does not",
    ),
}
