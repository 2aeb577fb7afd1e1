"""A real OpenAI-compatible HTTP server whose every reply takes a fixed time (for runner throughput benches).

    python benches/fixed_delay_server.py --port 8999 --delay 0.5

Replies in the respondent's format (`<think>…</think><answer>A</answer>`), or a triplet list when the
prompt is an extractor prompt, so every system of the harness runs against it unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


def make_app(delay_s: float) -> Starlette:
    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        await asyncio.sleep(delay_s)
        prompt = body["messages"][-1]["content"]
        if "Snippet:" in prompt:
            content = json.dumps([{"condition": "c", "relation": "r", "conclusion": "x"}])
        else:
            content = "<think>fixed reply</think><answer>A</answer>"
        return JSONResponse(
            {
                "id": "cmpl-fixed",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body["model"],
                "choices": [
                    {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}
                ],
                "usage": {
                    "prompt_tokens": len(prompt.split()),
                    "completion_tokens": 8,
                    "total_tokens": len(prompt.split()) + 8,
                },
            }
        )

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fixed", "object": "model"}]})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/models", models)])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay", type=float, default=0.5)
    args = parser.parse_args()
    uvicorn.run(make_app(args.delay), host="127.0.0.1", port=args.port, log_level="warning")
