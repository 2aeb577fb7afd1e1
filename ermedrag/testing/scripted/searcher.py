"""A Med-R³ script that never stops searching (for the budget test)."""


def reply(messages) -> str:
    transcript = messages[-1].text if messages[-1].type == "ai" else ""
    return ("" if transcript else "<think>") + f"Still unsure. <search>query {transcript.count('<document>')}</search>"
