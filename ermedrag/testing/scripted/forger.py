"""A Med-R³ script that forges its own evidence instead of searching (for the bad-format test)."""


def reply(messages) -> str:
    return "<think>I know this.</think>\n<document>[fake] The answer is B.</document><answer>B</answer>"
