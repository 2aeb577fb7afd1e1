"""The `openai:` backend: any OpenAI-compatible chat server (vLLM, llama.cpp's server, `transformers serve`, the
OpenAI API), as a LangChain chat model that returns the text as the model wrote it.

Every request streams (`"stream": true`), whether the caller streams or not, because that is what lets the client:
- find the stop string itself and close the stream there (`tools.server_reply`): servers cut it and most do not
  say which one ended the reply, so a parser would never see `</answer>` or `</search>`;
- cut a reply that runs past the token limit (a server may ignore the field it was sent in);
- hold each attempt to one deadline, connect to last byte (`--timeout`): a server trickling a byte at a time is
  stopped like a silent one.

What reaches the server, per server (`ServerTraits`, learnt from its own replies):
- the token limit as both `max_tokens` (llama.cpp reads only this) and `max_completion_tokens` (what the OpenAI API
  and `transformers serve` prefer); a server that refuses one of them (HTTP 400/422 naming it) is asked again at
  once without it, and never sent it again;
- no top-k, min-p or repetition penalty (`NEUTRAL_SAMPLING`), as the in-process backends sample: llama.cpp's server
  would otherwise penalise repeats and vLLM apply the model's generation config; servers that know none of these
  fields refuse them, once;
- for vLLM (recognised by the `stop_reason` its choices carry): `stop` with `include_stop_str_in_output`, so it
  stops generating at once and keeps the string, and `continue_final_message` when the conversation ends in an
  assistant turn (Med-R³ resuming after a search). Other servers reject those fields (`transformers serve`: HTTP
  422) or ignore them (llama.cpp's server would then cut the stop string off again), so they never get them;
- for every other server, a conversation that ends in an assistant turn (answer extraction, Med-R³ after a search)
  goes to the completions endpoint as one prompt rendered by the model's own chat template, continued where the
  turn stops (`tools.model_server.continuation`; the template from `ERMEDRAG_SERVER_TOKENIZER`, else the served model's name
  when its tokenizer is cached here). A chat request would have the server close that turn and open a new one, so
  the model never wrote what the prefilled turn asks for (measured: 1 of 3 questions answered through llama.cpp's
  server and `transformers serve`, 3 of 3 in process).

Every failure is one `ModelServerError` with a one-line message naming the URL, what went wrong and the setting to
change; retries (exponential backoff, bounded) happen here. Calls from synchronous code run on one background event
loop (`BackgroundLoop`), so that the deadline can cancel a call in any phase.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Coroutine, Iterator, Sequence, TypeVar

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict, Field

from ermedrag.agents.base import CHAT_ROLES, block_image_url
from ermedrag.tools.model_server.continuation import continuation_prompt, template_tokenizer
from ermedrag.tools.model_server.policy import (
    ModelServerError,
    ServerPolicy,
    HTTPStatus,
    check_sampling,
    classify_failure,
    is_retryable,
    server_error_message,
)
from ermedrag.tools.model_server.replies import (
    MAX_BODY_BYTES,
    EventDecoder,
    ReplyAssembler,
    ReplyShapeError,
    ServerReply,
    check_stops,
    error_detail,
    parse_completion_body,
)

T = TypeVar("T")


# ------------------------------------------------------------------------------------------ what to send


@dataclass
class ServerTraits:
    """What one server (by base URL) was seen to do, so later requests are sent in the form it takes."""

    vllm: bool = False  # its choices carry `stop_reason`: it takes `stop` + `include_stop_str_in_output`
    refused: set[str] = field(default_factory=set)  # optional fields it answered HTTP 400/422 to


# Fields a request can do without: a server refusing one (HTTP 400/422 naming it) gets the request again without it,
# at once, and never again. Of the two token-limit fields one always stays (the other then still carries the limit).
# NEUTRAL_SAMPLING asks for what the in-process backends do (no top-k, no min-p, no repetition penalty) under the
# names llama.cpp's and vLLM's servers read: llama-cpp-python's server otherwise applies a repetition penalty of
# 1.1, and vLLM the model's own generation config, so greedy replies differed from the same weights in process. A
# server that knows none of them (the OpenAI API, `transformers serve`) refuses them: they go together.
NEUTRAL_SAMPLING = {"top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0, "repetition_penalty": 1.0}  # top_k 0: all
OPTIONAL_FIELDS = ("max_tokens", "max_completion_tokens", "stream_options", *NEUTRAL_SAMPLING)
_TRAITS: dict[str, ServerTraits] = {}
_TRAITS_LOCK = threading.Lock()


def server_traits(base_url: str) -> ServerTraits:
    with _TRAITS_LOCK:
        return _TRAITS.setdefault(base_url.rstrip("/"), ServerTraits())


def refused_fields(status: int, detail: str, body: dict[str, Any]) -> set[str]:
    """The optional fields to leave out after the server refused `body` with `status` and `detail`: those its
    words name (a neutral sampling field takes the others with it); when a 400/422 names none, the neutral sampling
    fields the body carried (the only ones not every chat server knows); else nothing (the refusal stands).
    llama-cpp-python's server answers a field it cannot validate with HTTP 500 naming it: also a refusal."""
    if status not in (400, 422, 500):
        return set()
    limits = [name for name in ("max_tokens", "max_completion_tokens") if name in body]
    droppable = [name for name in OPTIONAL_FIELDS if name in body and (name not in limits or len(limits) == 2)]
    named = next((name for name in droppable if name in detail), None)
    neutral = {name for name in NEUTRAL_SAMPLING if name in body}
    if named is None:
        return neutral if status != 500 else set()
    return neutral if named in NEUTRAL_SAMPLING else {named}


SCORED_TOP_LOGPROBS = 20  # the most the OpenAI API returns; a call scoring option letters reads them among these


def request_body(
    model: str,
    messages: Sequence[BaseMessage],
    *,
    stops: Sequence[str],
    max_tokens: int,
    temperature: float,
    top_p: float,
    seed: int | None,
    logprobs: bool,
    traits: ServerTraits,
    top_logprobs: int = 0,
    prompt: str | None = None,
) -> dict[str, Any]:
    """The JSON a server gets for one call (see the module's docstring for why each field is there): a chat
    request, or with `prompt` (a rendered continuation) a request to the completions endpoint."""
    body: dict[str, Any] = {
        "model": model,
        **({"prompt": prompt} if prompt is not None else {"messages": openai_messages(messages)}),
        "stream": True,
        "temperature": temperature,
        "top_p": top_p,
    }
    if prompt is not None:
        body["max_tokens"] = max_tokens  # the completions endpoint's only limit field
    else:
        for name in ("max_tokens", "max_completion_tokens"):
            if name not in traits.refused:
                body[name] = max_tokens
    if "stream_options" not in traits.refused:
        body["stream_options"] = {"include_usage": True}
    body |= {
        name: value
        for name, value in NEUTRAL_SAMPLING.items()
        if name not in traits.refused and not (traits.vllm and name == "repeat_penalty")
    }  # llama.cpp's name
    if seed is not None:
        body["seed"] = seed
    if prompt is not None:
        if logprobs or top_logprobs:
            body["logprobs"] = max(top_logprobs, 1)  # the completions endpoint: how many alternatives a token
        return body  # a continued prompt: no chat-template fields
    if logprobs or top_logprobs:
        body["logprobs"] = True
    if top_logprobs:
        body["top_logprobs"] = top_logprobs
    if traits.vllm:
        if stops:
            body["stop"] = list(stops)
            body["include_stop_str_in_output"] = True
        if messages and messages[-1].type == "ai":
            body["add_generation_prompt"] = False
            body["continue_final_message"] = True
    return body


def openai_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages as chat-completion messages; image blocks as URLs a server can read (files become
    base64 data URIs, `tools.images.as_url`)."""
    from ermedrag.tools.images import as_url

    converted = []
    for message in messages:
        role = CHAT_ROLES.get(message.type)
        if role is None:
            raise ValueError(f"a {message.type!r} message cannot be sent to a chat server (system, human, ai only)")
        content = message.content
        if isinstance(content, list):
            blocks = []
            for block in content:
                url = block_image_url(block)
                if url is not None:
                    blocks.append({"type": "image_url", "image_url": {"url": as_url(url)}})
                elif isinstance(block, str):
                    blocks.append({"type": "text", "text": block})
                elif isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
                    blocks.append({"type": "text", "text": block["text"]})
                else:
                    raise ValueError(
                        f"a message content block of type {type(block).__name__} "
                        f"{str(block)[:60]!r} cannot be sent to a chat server (text and image_url only)"
                    )
            content = blocks
        converted.append({"role": role, "content": content})
    return converted


# ------------------------------------------------------------------------------------------ the transport


class BackgroundLoop:
    """One event loop in a daemon thread, where every server call of this process runs (one HTTP client, one
    connection pool). Synchronous callers wait on it; asynchronous ones await it from their own loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.pid = os.getpid()
        self._client: Any = None
        threading.Thread(target=self.loop.run_forever, name="ermedrag-model-server", daemon=True).start()

    def client(self) -> Any:
        """The HTTP client (made on the loop's thread, on first use). Timeouts are set per request."""
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(
                limits=httpx.Limits(max_connections=512, max_keepalive_connections=64), follow_redirects=False
            )
        return self._client

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # an interrupted caller (Ctrl-C) stops the call on the loop too
            raise

    async def arun(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self.loop))

    def iterate(self, produce: Callable[[Callable[[Any], None]], Coroutine[Any, Any, None]]) -> Iterator[Any]:
        """Run `produce(emit)` on the loop and yield what it emits, as it comes; its error is raised here."""
        items: queue.Queue[tuple[str, Any]] = queue.Queue()

        async def main() -> None:
            try:
                await produce(lambda item: items.put(("item", item)))
            except BaseException as err:  # noqa: BLE001 - handed to the consumer, raised there
                items.put(("error", err))
            else:
                items.put(("end", None))

        future = asyncio.run_coroutine_threadsafe(main(), self.loop)
        try:
            while True:
                kind, value = items.get()
                if kind == "item":
                    yield value
                elif kind == "error":
                    raise value
                else:
                    return
        finally:
            future.cancel()  # the consumer stopped early (or failed): stop the producer too

    async def aiterate(
        self, produce: Callable[[Callable[[Any], None]], Coroutine[Any, Any, None]]
    ) -> AsyncIterator[Any]:
        here = asyncio.get_running_loop()
        items: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def put(kind: str, value: Any) -> None:
            here.call_soon_threadsafe(items.put_nowait, (kind, value))

        async def main() -> None:
            try:
                await produce(lambda item: put("item", item))
            except BaseException as err:  # noqa: BLE001
                put("error", err)
            else:
                put("end", None)

        future = asyncio.run_coroutine_threadsafe(main(), self.loop)
        try:
            while True:
                kind, value = await items.get()
                if kind == "item":
                    yield value
                elif kind == "error":
                    raise value
                else:
                    return
        finally:
            future.cancel()


_BACKGROUND: BackgroundLoop | None = None
_BACKGROUND_LOCK = threading.Lock()


def background() -> BackgroundLoop:
    """This process's background loop (a forked child makes its own: threads do not survive a fork)."""
    global _BACKGROUND
    with _BACKGROUND_LOCK:
        if _BACKGROUND is None or _BACKGROUND.pid != os.getpid():
            _BACKGROUND = BackgroundLoop()
        return _BACKGROUND


async def read_reply(
    client: Any,
    url: str,
    headers: dict[str, str],
    body: dict[str, Any],
    assembler: ReplyAssembler,
    policy: ServerPolicy,
    emit: Callable[[str], None] | None = None,
) -> ServerReply:
    """One attempt: POST `body`, read the reply (streamed or whole) into `assembler`, all within the policy's
    deadline; text is passed to `emit` as it becomes safe to show. Raises what went wrong (classify_failure)."""
    import httpx

    timeout = httpx.Timeout(policy.timeout_s, connect=min(policy.connect_timeout_s, policy.timeout_s))
    async with asyncio.timeout(policy.timeout_s):
        async with client.stream("POST", url, json=body, headers=headers, timeout=timeout) as response:
            if response.status_code >= 400:
                raise HTTPStatus(response.status_code, error_detail(await _read_limited(response, 65536)))
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                return await _read_events(response, assembler, emit)
            payload = parse_completion_body(await _read_limited(response, MAX_BODY_BYTES))
            text = assembler.add_completion(payload)
            reply, rest = assembler.finish(stream_closed_cleanly=True)
            if emit and text + rest:
                emit(text + rest)
            return reply


async def _read_events(response: Any, assembler: ReplyAssembler, emit: Callable[[str], None] | None) -> ServerReply:
    decoder, ended = EventDecoder(), False
    async for raw in response.aiter_raw():
        for payload in decoder.feed(raw):
            if payload.strip() == "[DONE]":
                ended = True
                break
            text = assembler.add_chunk(payload)
            if emit and text:
                emit(text)
            if assembler.done:
                break
        if ended or assembler.done:
            break
    else:
        for payload in decoder.close():
            if payload.strip() == "[DONE]":
                ended = True
            elif not assembler.done:
                text = assembler.add_chunk(payload)
                if emit and text:
                    emit(text)
        ended = ended or assembler.finish_reason is not None
    reply, rest = assembler.finish(stream_closed_cleanly=ended)
    if emit and rest:
        emit(rest)
    return reply


async def _read_limited(response: Any, limit: int) -> bytes:
    data = bytearray()
    async for raw in response.aiter_raw():
        data += raw
        if len(data) > limit:
            raise ReplyShapeError(f"the reply is larger than {limit // 2**20 or 1} MB")
    return bytes(data)


# ----------------------------------------------------------------------------------------- the chat model


class ServerChatModel(BaseChatModel):
    """A model behind an OpenAI-compatible server (`openai:NAME`). See the module's docstring."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    model_name: str
    base_url: str
    api_key: str = "EMPTY"
    spec: str = ""
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int | None = None
    logprobs: bool = False
    policy: ServerPolicy = Field(default_factory=ServerPolicy)
    image_refusal: str | None = None  # why images are refused (a model declared text-only), or None: it sees them
    tokenizer: str = ""  # ERMEDRAG_SERVER_TOKENIZER: whose chat template renders continuations; "" = model_name's

    @property
    def _llm_type(self) -> str:
        return "ermedrag-openai-server"

    def scores_answer_tokens(self) -> bool:
        """Whether it can score an answer's option letters (`graphs.steps.with_confidence`): the conversation must
        be continued where the answer starts, which only vLLM's server does (`continue_final_message`; others answer
        a final assistant message with a new turn). Known once the server has answered a call."""
        return server_traits(self.base_url).vllm

    @property
    def chat_url(self) -> str:
        return self.base_url.rstrip("/") + "/chat/completions"

    @property
    def completions_url(self) -> str:
        return self.base_url.rstrip("/") + "/completions"

    def continued_prompt(self, messages: list[BaseMessage], traits: ServerTraits) -> str | None:
        """The prompt continuing `messages`' final assistant turn, for a server that cannot continue it in a chat
        request (all but vLLM's); None when a chat request serves (or no chat template is known: then logged)."""
        from ermedrag.tools.images import images_in

        if traits.vllm or not messages or messages[-1].type != "ai" or images_in(messages):
            return None
        tokenizer = template_tokenizer(self.tokenizer or self.model_name, bool(self.tokenizer))
        return continuation_prompt(tokenizer, messages) if tokenizer is not None else None

    # ---------------------------------------------------------------------------------------- LangChain

    def _generate(self, messages, stop=None, run_manager=None, **kwargs) -> ChatResult:
        return _result(background().run(self._call(messages, stop, kwargs)), self.spec)

    async def _agenerate(self, messages, stop=None, run_manager=None, **kwargs) -> ChatResult:
        return _result(await background().arun(self._call(messages, stop, kwargs)), self.spec)

    def _stream(self, messages, stop=None, run_manager=None, **kwargs) -> Iterator[ChatGenerationChunk]:
        """Streamed calls (LangGraph's "messages" mode, Studio): text as it comes, never past a stop string;
        retried only while nothing has been shown."""
        for item in background().iterate(lambda emit: self._call(messages, stop, kwargs, emit, stream=True)):
            chunk = _chunk(item, self.spec)
            if run_manager and chunk.text:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(self, messages, stop=None, run_manager=None, **kwargs) -> AsyncIterator[ChatGenerationChunk]:
        async for item in background().aiterate(lambda emit: self._call(messages, stop, kwargs, emit, stream=True)):
            chunk = _chunk(item, self.spec)
            if run_manager and chunk.text:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    # ------------------------------------------------------------------------------------------- a call

    async def _call(
        self,
        messages: list[BaseMessage],
        stop: Sequence[str] | None,
        kwargs: dict[str, Any],
        emit: Callable[[Any], None] | None = None,
        stream: bool = False,
    ) -> ServerReply:
        """The reply after at most max_retries retries; with `emit`, its text is passed on as it arrives and the
        finished reply last (`stream`: a retry only while no text was passed on)."""
        stops = check_stops(stop)
        max_tokens = kwargs.get("max_new_tokens", self.max_new_tokens)
        check_sampling(temperature=self.temperature, top_p=self.top_p, max_new_tokens=max_tokens)
        self._check_images(messages)
        if max_tokens == 0:  # nothing to generate: no request (servers refuse a limit of 0)
            reply = ServerReply(
                "",
                "length",
                None,
                None,
                {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0},
                True,
                None,
                None,
                None,
            )
            if emit:
                emit(reply)
            return reply
        traits = server_traits(self.base_url)
        prompt = self.continued_prompt(messages, traits)
        url = self.chat_url if prompt is None else self.completions_url
        shown = False

        def show(text: str) -> None:
            nonlocal shown
            shown = True
            if emit:
                emit(text)

        attempt, renegotiations = 1, 0
        while True:
            body = request_body(
                self.model_name,
                messages,
                stops=stops,
                max_tokens=max_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                seed=self.seed,
                logprobs=self.logprobs,
                traits=traits,
                top_logprobs=SCORED_TOP_LOGPROBS if kwargs.get("score_tokens") else 0,
                prompt=prompt,
            )
            assembler = ReplyAssembler(stops, max_tokens)
            try:
                reply = await read_reply(
                    background().client(),
                    url,
                    self._headers(),
                    body,
                    assembler,
                    self.policy,
                    show if emit else None,
                )
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - every failure of an attempt is the server's (classified)
                refused = refused_fields(err.status, err.detail, body) if isinstance(err, HTTPStatus) else set()
                if refused and renegotiations < len(OPTIONAL_FIELDS):
                    traits.refused |= refused  # ask again at once without them; not a retry
                    renegotiations += 1
                    continue
                cause, detail = classify_failure(err)
                if (stream and shown) or attempt > self.policy.max_retries or not is_retryable(cause):
                    url, model = self.base_url, self.spec or f"openai:{self.model_name}"
                    raise ModelServerError(
                        server_error_message(cause, detail, url, model, self.policy, attempt),
                        url,
                        model,
                        cause,
                        attempt,
                    ) from err
                await asyncio.sleep(self.policy.backoff_s(attempt - 1))
                attempt += 1
                continue
            traits.vllm = traits.vllm or assembler.saw_stop_reason_field
            if emit:
                emit(reply)
            return reply

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}", "Accept": "text/event-stream, application/json"}

    def _check_images(self, messages: list[BaseMessage]) -> None:
        from ermedrag.tools.images import ImagesNotSupportedError, images_in

        if self.image_refusal and images_in(messages):
            raise ImagesNotSupportedError(self.image_refusal)


def _metadata(reply: ServerReply, spec: str) -> dict[str, Any]:
    return {
        "model_name": spec,
        "server_model": reply.model,
        "finish_reason": reply.finish_reason,
        "stop_sequence": reply.stop_sequence,
        "cut_by_client": reply.cut_by_client,
        "server_stop_reason": reply.server_stop_reason,
        "usage_counted": reply.usage_counted,
        "logprobs": {"content": reply.logprobs} if reply.logprobs is not None else None,
    }


def _result(reply: ServerReply, spec: str) -> ChatResult:
    message = AIMessage(content=reply.text, usage_metadata=reply.usage, response_metadata=_metadata(reply, spec))
    return ChatResult(generations=[ChatGeneration(message=message)])


def _chunk(item: str | ServerReply, spec: str) -> ChatGenerationChunk:
    """A piece of text, or (last) the reply's usage and metadata with no text of its own."""
    if isinstance(item, str):
        return ChatGenerationChunk(message=AIMessageChunk(content=item))
    return ChatGenerationChunk(
        message=AIMessageChunk(content="", usage_metadata=item.usage, response_metadata=_metadata(item, spec))
    )
