"""Continuing an assistant turn through a server that cannot continue one in a chat request (every server but
vLLM's): the conversation becomes one prompt for the completions endpoint, rendered by the model's own chat template
continuing the last turn (`continuation_prompt`), so the server feeds the model the tokens the in-process backends
feed it. Answer extraction (a turn prefilled up to `<answer>`) and Med-R³ after a search need it: through a chat
request llama.cpp's server and `transformers serve` close the turn and open a new one (measured: 1 of 3 questions
answered where in process 3 of 3 were).

The template comes from the tokenizer `template_tokenizer` loads: the one ERMEDRAG_SERVER_TOKENIZER names, else the
served model's name when it names a tokenizer on this machine (hub cache, folder or GGUF file).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Sequence

from langchain_core.messages import BaseMessage

from ermedrag.agents.base import continuation, to_chat

log = logging.getLogger(__name__)


def continuation_prompt(tokenizer: Any, messages: Sequence[BaseMessage]) -> str:
    """`messages` (ending in an assistant turn) as the text the in-process backends feed the model: the chat
    template continuing the last turn, without its leading BOS token, which servers add when they tokenize."""
    prompt = tokenizer.apply_chat_template(to_chat(messages), tokenize=False, **continuation(messages))
    bos = getattr(tokenizer, "bos_token", None)
    return prompt[len(bos) :] if bos and prompt.startswith(bos) else prompt


def gguf_chat_template(path: str) -> str | None:
    """The chat template a GGUF file carries (`tokenizer.chat_template`; transformers does not read it)."""
    from gguf import GGUFReader

    field = GGUFReader(path).fields.get("tokenizer.chat_template")
    return bytes(field.parts[field.data[0]]).decode("utf-8") if field is not None and field.data else None


@functools.lru_cache(maxsize=16)
def template_tokenizer(source: str, named: bool) -> Any | None:
    """The tokenizer whose chat template renders continuations for a server: `source` is a folder, a hub id or a
    GGUF file. `named` (set in ERMEDRAG_SERVER_TOKENIZER): a failure is a ValueError naming the setting;
    otherwise `source` is the served model's name, tried from local files only, and None (logged once) when it
    names no tokenizer here."""
    from transformers import AutoTokenizer

    try:
        if source.endswith(".gguf") and os.path.isfile(source):  # llama.cpp's server names a model by its file
            folder, name = os.path.split(source)
            tokenizer = AutoTokenizer.from_pretrained(folder or ".", gguf_file=name)
            tokenizer.chat_template = tokenizer.chat_template or gguf_chat_template(source)
        else:
            tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=not named)
        problem = None if getattr(tokenizer, "chat_template", None) else "it has no chat template"
    except Exception as err:  # noqa: BLE001 - any loading failure means: no template from here
        tokenizer, problem = None, " ".join(f"{type(err).__name__}: {err}".split())[:200]
    if problem is None:
        return tokenizer
    if named:
        raise ValueError(f"ERMEDRAG_SERVER_TOKENIZER={source!r}: cannot render the model's chat template ({problem})")
    log.warning(
        "model server: no local tokenizer for %r (%s), so a conversation ending in an assistant turn (answer "
        "extraction, Med-R³ after a search) is answered as a new turn by servers other than vLLM's; set "
        "ERMEDRAG_SERVER_TOKENIZER to the served model's tokenizer to continue it",
        source,
        problem,
    )
    return None
