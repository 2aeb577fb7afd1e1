"""Continuing an assistant turn through servers other than vLLM's: the conversation goes to the completions endpoint
as the prompt the model's chat template makes (`tools.model_server.continuation`). What the servers do
with it is tested against real ones (test_real_servers.py); here, that the prompt is the very token sequence the
in-process backends feed the model, and that the completions endpoint's replies are read like chat replies."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from ermedrag.agents import reasoner, respondent
from ermedrag.agents.base import continuation, to_chat
from ermedrag.tools.model_server.client import ServerChatModel, ServerTraits, request_body
from ermedrag.tools.model_server.continuation import continuation_prompt, template_tokenizer
from ermedrag.tools.model_server.replies import ReplyAssembler, ReplyShapeError

OPTIONS = {"A": "Insulin", "B": "Metformin"}
CONTINUED = {
    "answer_extraction": respondent.extraction_messages("First-line drug?", OPTIONS, "metformin is first line"),
    "med_r3_after_a_search": reasoner.build_messages(
        "First-line drug?", OPTIONS, "<think>Check. <search>metformin</search><document>[1] first line</document>"
    ),
}


@pytest.mark.parametrize("conversation", CONTINUED)
def test_the_continued_prompt_is_the_token_sequence_the_in_process_backends_feed(tiny_model, conversation):
    """A server tokenizes the prompt as text, adding its BOS token (transformers serve, llama.cpp's and vLLM's):
    the result must be the in-process backend's `apply_chat_template(..., continue_final_message=True)`."""
    messages = CONTINUED[conversation]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompt = continuation_prompt(tokenizer, messages)
    in_process = tokenizer.apply_chat_template(
        to_chat(messages), tokenize=True, return_dict=False, **continuation(messages)
    )
    assert prompt.endswith(messages[-1].content)  # the turn is left open where the model continues
    assert tokenizer(prompt)["input_ids"] == list(in_process)


def test_a_leading_bos_is_left_to_the_server(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.bos_token = "<|endoftext|>"
    tokenizer.chat_template = "{{ bos_token }}" + tokenizer.chat_template
    prompt = continuation_prompt(tokenizer, CONTINUED["answer_extraction"])
    assert not prompt.startswith("<|endoftext|>")


def test_a_continuation_goes_to_the_completions_endpoint_without_chat_fields():
    body = request_body(
        "m",
        CONTINUED["answer_extraction"],
        stops=respondent.STOP,
        max_tokens=8,
        temperature=0.0,
        top_p=1.0,
        seed=3,
        logprobs=False,
        traits=ServerTraits(),
        top_logprobs=20,
        prompt="<prompt>",
    )
    assert body["prompt"] == "<prompt>" and "messages" not in body
    assert body["max_tokens"] == 8 and "max_completion_tokens" not in body
    assert body["logprobs"] == 20 and "top_logprobs" not in body  # the completions endpoint's form
    assert not {"stop", "continue_final_message", "add_generation_prompt", "include_stop_str_in_output"} & set(body)


def test_only_a_conversation_ending_in_an_assistant_turn_to_a_server_other_than_vllm_is_rendered(tiny_model):
    model = ServerChatModel(model_name="m", base_url="http://127.0.0.1:9/v1", tokenizer=tiny_model)
    continued = CONTINUED["answer_extraction"]
    assert model.continued_prompt(continued, ServerTraits()) == continuation_prompt(
        AutoTokenizer.from_pretrained(tiny_model), continued
    )
    assert model.continued_prompt(continued, ServerTraits(vllm=True)) is None  # vLLM continues it in chat
    assert model.continued_prompt(continued[:-1], ServerTraits()) is None  # a new turn: a chat request


def test_a_named_tokenizer_that_does_not_load_is_an_error_naming_the_setting(tmp_path):
    with pytest.raises(ValueError, match=r"ERMEDRAG_SERVER_TOKENIZER=.*cannot render"):
        template_tokenizer(str(tmp_path / "nothing"), True)
    # The served model's name is only tried: no tokenizer there is a chat request (and a warning), not a failure.
    assert template_tokenizer(str(tmp_path / "nothing"), False) is None


def _text_chunk(text: str, finish: str | None = None, **extra) -> str:
    return json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": finish, **extra}]})


def test_completions_chunks_are_read_like_chat_chunks_up_to_the_stop_string():
    assembler = ReplyAssembler(respondent.STOP, 8)
    for piece in ("B", "</ans", "wer> and more"):
        assembler.add_chunk(_text_chunk(piece))
        if assembler.done:
            break
    reply, _ = assembler.finish(stream_closed_cleanly=False)
    assert (reply.text, reply.stop_sequence, reply.finish_reason) == ("B", "</answer>", "stop")  # OpenAI: cut there


def test_completions_logprobs_are_read_as_chat_logprobs():
    legacy = {"tokens": ["B"], "token_logprobs": [-0.1], "top_logprobs": [{"B": -0.1, "A": -2.5}]}
    assembler = ReplyAssembler((), 1)
    assembler.add_completion({"choices": [{"index": 0, "text": "B", "finish_reason": "length", "logprobs": legacy}]})
    reply, _ = assembler.finish(stream_closed_cleanly=True)
    assert reply.logprobs == [
        {
            "token": "B",
            "logprob": -0.1,
            "top_logprobs": [{"token": "B", "logprob": -0.1}, {"token": "A", "logprob": -2.5}],
        }
    ]


@pytest.mark.parametrize(
    "choice, words",
    [({"index": 0, "text": None}, "choices[0].text is null"), ({"index": 0, "text": 3}, "choices[0].text is a int")],
)
def test_a_completion_of_the_wrong_shape_is_named(choice, words):
    with pytest.raises(ReplyShapeError, match=words.replace("[", r"\[").replace("]", r"\]")):
        ReplyAssembler((), 4).add_completion({"choices": [choice]})
