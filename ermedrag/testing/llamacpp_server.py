"""llama.cpp's own OpenAI-compatible server (llama-cpp-python's `llama_cpp.server`) with the offline model's chat format.

The Gemma 3 270M base GGUF carries no chat template, and llama.cpp's server then formats every conversation as
Llama 2's. This registers the template the in-process backends use (`tools.offline_model.GEMMA_CHAT_TEMPLATE`,
ending a turn at <end_of_turn>) as the chat format `ermedrag-gemma`, then runs the server's own entry point:

    python -m ermedrag.testing.llamacpp_server --model FILE.gguf --host 127.0.0.1 --port 8001 [llama_cpp.server options]

Any other option of `python -m llama_cpp.server` passes through; `--chat_format` defaults to `ermedrag-gemma`.
"""

from __future__ import annotations

import sys

CHAT_FORMAT = "ermedrag-gemma"
GEMMA_STOP_TOKEN_IDS = [106, 1]  # <end_of_turn>, <eos>: where the converted offline model's generation ends


def register_chat_format() -> None:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter, register_chat_completion_handler

    from ermedrag.tools.models.offline import END_OF_TURN, GEMMA_CHAT_TEMPLATE

    formatter = Jinja2ChatFormatter(
        template=GEMMA_CHAT_TEMPLATE,
        eos_token=END_OF_TURN,
        bos_token="<bos>",
        add_generation_prompt=True,
        stop_token_ids=GEMMA_STOP_TOKEN_IDS,
    )
    register_chat_completion_handler(CHAT_FORMAT)(formatter.to_chat_handler())


def main() -> None:
    register_chat_format()
    if "--chat_format" not in sys.argv:
        sys.argv += ["--chat_format", CHAT_FORMAT]
    from llama_cpp.server.__main__ import main as serve

    serve()


if __name__ == "__main__":
    main()
