"""A Med-R³ script that thinks on and on without searching or answering, and answers "A" only when the system
asks for the answer (the transcript ends with the forcing prompt's `<answer>`)."""

WORDS_PER_STEP = 10


def reply(messages) -> str:
    transcript = messages[-1].text if messages[-1].type == "ai" else ""
    if transcript.rstrip().endswith("<answer>"):
        return "A</answer>"
    return ("" if transcript else "<think>") + " ".join(["hmm"] * WORDS_PER_STEP)
