"""A script whose replies name no option: the respondent answers in words that match no option text, the Med-R³
reasoner copies a document line into its answer. Asked again through answer extraction (the conversation ends in
the system's `<answer>`), it gives the letter of the option its reasoning named, or garbage when that reasoning
names none ("nothing")."""

import re

OPTION = re.compile(r"^([A-Z])\. (.*)$", re.MULTILINE)


def reply(messages) -> str:
    last = messages[-1]
    if last.type == "ai" and last.text.endswith("<answer>"):
        return _extracted(messages)
    if "<search>query</search>" in messages[0].text:  # the Med-R³ reasoner
        return "<think>Metformin lowers hepatic glucose output.</think><answer>[kb-1] a document line</answer>"
    return "<think>Metformin lowers hepatic glucose output.</think><answer>the biguanide one</answer>"


def _extracted(messages) -> str:
    question = next(m.text for m in reversed(messages) if m.type == "human")
    evidence = question.partition("Question:")[0]
    for key, text in OPTION.findall(question):
        if text.lower() in evidence.lower():
            return f"{key}</answer>"
    return "[kb-2] still no letter</answer>"
