"""The hf backend's generation statistics, memory and timing, and where the timing ends up (the trace store).

The statistics are checked against the way they were computed before (ask `generate` for every step's logits,
then reduce): on a tiny random model in the default run, on the real offline model in the slow run.
"""

from __future__ import annotations

import functools
import platform
import sqlite3
import threading
import time
from typing import Any

import pytest
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.outputs import ChatGeneration, ChatResult

from ermedrag.testing.tiny_model import build_tiny_causal_lm
from ermedrag.tools.agent_calls import call_agent, call_timing
from ermedrag.tools.models import load_chat_model
from ermedrag.tools.models.hf import (
    HFChatModel,
    _model_label,
    hf_generator,
    load_hf_model,
    return_large_blocks_to_the_os,
)
from ermedrag.tools.machine import checkpoint_dtype, cpu_has_native_bf16, inference_dtype
from ermedrag.tools.models.hf_batching import (
    MIN_SHARED_PREFIX,
    BatchingGenerator,
    Generated,
    GenerationParams,
    apportion_compute,
    padded_rows,
    shared_prefix_length,
)
from ermedrag.tools.settings import cache_home
from ermedrag.tools.records.traces import TraceEvent, TraceStore

TOLERANCE = 1e-4
GREEDY = GenerationParams(max_new_tokens=20)
SAMPLED = GenerationParams(max_new_tokens=20, temperature=0.9, top_p=0.9, seed=7)


# ----------------------------------------------------------------------------------- the reference (old path)


def reference_generate(
    generator: BatchingGenerator,
    prompts: list[list[int]],
    params: GenerationParams,
) -> list[Generated]:
    """What the hf backend computed before: every step's full-vocabulary logits from `generate`, reduced after. The
    rows in the batch's order (sorted by prompt, whatever order the calls came in), each returned in its call's."""
    import torch

    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    prompts = [prompts[i] for i in order]
    tokenizer, model = generator.tokenizer, generator.model
    pad, width = tokenizer.pad_token_id, max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    gen: dict[str, Any] = dict(
        max_new_tokens=params.max_new_tokens,
        do_sample=params.temperature > 0,
        return_dict_in_generate=True,
        output_logits=True,
        pad_token_id=pad,
    )
    if params.temperature > 0:
        gen.update(temperature=params.temperature, top_p=params.top_p, top_k=0)
    if params.stop:
        gen.update(stop_strings=list(params.stop), tokenizer=tokenizer)
    if params.seed is not None:
        torch.manual_seed(params.seed)
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention, **gen)
    new = out.sequences[:, width:]
    chosen, entropy = [], []
    for step, logits in enumerate(out.logits):
        logp = torch.log_softmax(logits.float(), dim=-1)
        chosen.append(logp.gather(1, new[:, step : step + 1]).squeeze(1))
        entropy.append(-(logp.exp() * torch.nan_to_num(logp, neginf=0.0)).sum(-1))
    chosen_rows, entropy_rows = torch.stack(chosen, 1).tolist(), torch.stack(entropy, 1).tolist()
    rows = [generator._row(new[b].tolist(), chosen_rows[b], entropy_rows[b]) for b in range(len(prompts))]
    return [rows[order.index(i)] for i in range(len(prompts))]


def assert_same_generation(new: list[Generated], reference: list[Generated]) -> None:
    assert len(new) == len(reference)
    for got, want in zip(new, reference):
        assert got.token_ids == want.token_ids and got.hit_eos == want.hit_eos
        assert [e["token"] for e in got.logprobs] == [e["token"] for e in want.logprobs]
        for g, w in zip(got.logprobs, want.logprobs):
            assert abs(g["logprob"] - w["logprob"]) <= TOLERANCE and abs(g["entropy"] - w["entropy"]) <= TOLERANCE


class GenerateSpy:
    """Wraps `model.generate` to keep the arguments and the result of each call."""

    def __init__(self, model: Any):
        self.model, self.original, self.calls = model, model.generate, []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self.original(*args, **kwargs)
        self.calls.append((kwargs, result))
        return result


# -------------------------------------------------------------------------------------- a tiny real model


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return build_tiny_causal_lm(tmp_path_factory.mktemp("tiny-hf") / "model")


@pytest.fixture(scope="module")
def tiny_generator(tiny_path: str) -> BatchingGenerator:
    """A generator of its own (not the shared cached one) whose model stops at many ids: rows end early."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_path).eval()
    # An output layer of its own: with the tied random embeddings, greedy decoding repeats the last prompt token,
    # and a misaligned token/log-prob pair would go unnoticed. Entropy ~3 nats: tokens differ clearly.
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(model.lm_head.weight.shape, generator=generator) * 0.3
    model.lm_head.weight = torch.nn.Parameter(weight)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, *range(40, 140)]  # ~13% per step
    return BatchingGenerator(tokenizer, model, "cpu", max_batch=8, gather_s=0.3)


def tiny_prompts(generator: BatchingGenerator) -> list[list[int]]:
    texts = [
        "Metformin lowers blood glucose.",
        "A 45-year-old man presents with chest pain radiating to the left arm. What is the most likely diagnosis?",
        "Heparin",
    ]
    return [generator.tokenizer(t)["input_ids"] for t in texts]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_streamed_statistics_equal_the_full_logits_ones_on_a_tiny_model(tiny_generator, params):
    prompts = tiny_prompts(tiny_generator)
    new = tiny_generator.generate_many(prompts, params)
    assert tiny_generator.batch_sizes[-1] == 3  # one padded batch, as the reference
    reference = reference_generate(tiny_generator, prompts, params)
    assert_same_generation(new, reference)
    assert len({len(g.token_ids) for g in new}) > 1 or params is GREEDY  # rows ended at different steps


def fan_out_prompts(generator: BatchingGenerator) -> list[list[int]]:
    """An extractor fan-out: one long instruction and question, then a snippet of each row's own."""
    shared = (
        generator.tokenizer(
            "Extract condition, relation and conclusion triplets from the snippet. Question: "
            "which drug should a 52-year-old man with type 2 diabetes and normal kidney "
            "function start first? Snippet:"
        )["input_ids"]
        * 2
    )
    snippets = [
        "Metformin lowers hepatic glucose output.",
        "Glipizide can cause hypoglycaemia in older adults who eat little.",
        "Pioglitazone",
        "Basal insulin is used when glucose is very high at diagnosis.",
    ]
    return [shared + generator.tokenizer(s)["input_ids"] for s in snippets]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_shared_prompt_prefix_is_computed_once_and_changes_nothing(tiny_generator, params, monkeypatch):
    prompts = fan_out_prompts(tiny_generator)
    shared = shared_prefix_length(prompts)
    assert shared >= MIN_SHARED_PREFIX
    forward_lengths: list[int] = []
    original_forward = tiny_generator.model.forward

    @functools.wraps(original_forward)  # generate reads forward's signature (position ids, logits to keep)
    def counting_forward(*args: Any, **kwargs: Any) -> Any:
        forward_lengths.append(kwargs["input_ids"].shape[1])
        return original_forward(*args, **kwargs)

    monkeypatch.setattr(tiny_generator.model, "forward", counting_forward)
    new = tiny_generator.generate_many(prompts, params)
    monkeypatch.undo()
    # the prefix once (batch 1), then only each row's rest, not the whole prompts again
    assert forward_lengths[0] == shared and forward_lengths[1] == max(len(p) for p in prompts) - shared
    assert_same_generation(new, reference_generate(tiny_generator, prompts, params))


def test_padding_goes_between_the_shared_prefix_and_each_rows_rest():
    prompts = [[5, 6, 7, 8, 9], [5, 6, 7, 1], [5, 6, 7, 2, 3, 4]]
    assert shared_prefix_length(prompts) == 3
    assert shared_prefix_length([[5, 6, 7], [5, 6, 7]]) == 2  # every row keeps a token of its own to start from
    ids, masks = padded_rows(prompts, 3, pad=0)
    assert ids == [[5, 6, 7, 0, 8, 9], [5, 6, 7, 0, 0, 1], [5, 6, 7, 2, 3, 4]]
    assert masks == [[1, 1, 1, 0, 1, 1], [1, 1, 1, 0, 0, 1], [1, 1, 1, 1, 1, 1]]
    assert padded_rows(prompts, 0, pad=0)[0][1] == [0, 0, 5, 6, 7, 1]  # no shared prefix: left padding


def test_generation_never_asks_for_per_step_vocabulary_arrays(tiny_generator, monkeypatch):
    import torch

    spy = GenerateSpy(tiny_generator.model)
    monkeypatch.setattr(tiny_generator.model, "generate", spy)
    tiny_generator.generate_many(tiny_prompts(tiny_generator), SAMPLED)
    ((kwargs, result),) = spy.calls
    assert not kwargs.get("output_logits") and not kwargs.get("output_scores")
    assert kwargs["return_dict_in_generate"] is False and isinstance(result, torch.Tensor)  # ids only, no cache
    stats = kwargs["logits_processor"][0]
    # What it kept: one number per row and step; the last step's [batch, vocab] row set is released.
    assert stats._current is None and all(t.dim() == 1 for t in stats.chosen + stats.entropy)


def test_step_statistics_pair_each_token_with_the_step_that_chose_it_and_drop_undone_steps():
    import torch

    from ermedrag.tools.models.hf_batching import StepStatistics

    steps = [
        torch.tensor([[0.0, 1.0, 2.0], [2.0, 0.0, 0.0]]),
        torch.tensor([[1.0, 1.0, 1.0], [0.0, 5.0, 0.0]]),
        torch.tensor([[3.0, 0.0, 0.0], [0.0, 0.0, 4.0]]),
    ]  # the third step ran, then generate undid it
    chosen_ids = torch.tensor([[2, 0, 1], [0, 1, 2]])
    stats, prompt = StepStatistics(), torch.tensor([[7], [7]])
    for t, scores in enumerate(steps):
        assert stats(torch.cat([prompt, chosen_ids[:, :t]], dim=1), scores) is scores  # scores pass unchanged
    logprobs, entropies = stats.finish(chosen_ids[:, :2])
    expected = [[torch.log_softmax(steps[t][b], -1)[chosen_ids[b, t]].item() for t in range(2)] for b in range(2)]
    assert [len(row) for row in logprobs + entropies] == [2, 2, 2, 2]
    assert sum(logprobs, []) == pytest.approx(sum(expected, []))
    assert entropies[0][1] == pytest.approx(torch.log(torch.tensor(3.0)).item())  # uniform over 3
    assert stats.finish(chosen_ids[:, :0]) == ([[], []], [[], []])


def test_each_request_reports_its_queue_wait_and_compute_share(tiny_generator):
    first_params, second_params = GenerationParams(max_new_tokens=30), GenerationParams(max_new_tokens=10)
    results: dict[str, list[Generated]] = {}
    prompts = tiny_prompts(tiny_generator)

    def submit(name: str, params: GenerationParams) -> None:
        results[name] = tiny_generator.generate_many(prompts, params)

    threads = [
        threading.Thread(target=submit, args=(name, params))
        for name, params in (("a", first_params), ("b", second_params))
    ]
    for thread in threads:  # both arrive within the 0.3 s gathering window; different params: two batches
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    first, second = sorted(results.values(), key=lambda rows: rows[0].queue_s)
    assert all(r.batch_size == 3 and r.queue_s >= 0 and r.compute_s > 0 for r in first + second)
    # The second batch waited for the whole first one: its queue wait covers the first batch's compute.
    assert min(r.queue_s for r in second) >= sum(r.compute_s for r in first) * 0.999


def test_apportioning_splits_the_prompt_pass_by_prompt_and_the_steps_by_generated_tokens():
    shares = apportion_compute(1.0, 3.0, prompt_tokens=[10, 30], new_tokens=[1, 2])
    assert shares == pytest.approx([0.25 + 1.0, 0.75 + 2.0])
    assert sum(apportion_compute(0.4, 2.0, [5, 5, 10], [0, 7, 3])) == pytest.approx(2.4)
    assert apportion_compute(0.0, 1.2, [3, 3, 3], [0, 0, 0]) == pytest.approx([0.4, 0.4, 0.4])  # nothing written
    assert apportion_compute(1.0, 1.0, [], []) == []


# ----------------------------------------------------------------------------------- model loading (point 8)


def test_the_dtype_follows_the_checkpoint_on_cpu_and_the_setting_overrides_it(tmp_path, monkeypatch):
    import torch

    monkeypatch.delenv("ERMEDRAG_DTYPE", raising=False)
    path = build_tiny_causal_lm(tmp_path / "model")  # saved in float32
    assert checkpoint_dtype(path) == "float32"
    assert inference_dtype("cpu", checkpoint_dtype(path)) == torch.float32  # never below what was stored
    assert inference_dtype("cpu", None) == torch.float32  # unknown: the safe choice
    expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32  # never emulated
    assert inference_dtype("cpu", "bfloat16") == expected
    assert inference_dtype("cuda", "float32") == torch.bfloat16
    assert inference_dtype("cpu", "float32", single_pass=True) == expected  # an encoder: one pass, compared by cosine
    monkeypatch.setenv("ERMEDRAG_DTYPE", "float32")
    assert inference_dtype("cpu", "bfloat16") == torch.float32
    monkeypatch.setenv("ERMEDRAG_DTYPE", "half")
    with pytest.raises(ValueError, match="ERMEDRAG_DTYPE='half': expected one of auto, float32, bfloat16"):
        inference_dtype("cpu", None)


def test_loading_says_what_it_loads_once_without_progress_bars(tmp_path, capfd):
    from transformers.utils import logging as hf_logging

    path = build_tiny_causal_lm(tmp_path / "model")  # a path of its own: not loaded (cached) by another test
    capfd.readouterr()
    bars_before = hf_logging.is_progress_bar_enabled()
    load_hf_model(path, "cpu")
    assert hf_logging.is_progress_bar_enabled() == bars_before  # quiet while loading only
    load_hf_model(path, "cpu")  # cached: silent
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    threads = _threads()
    assert lines == [f"loading model hf:{path} on cpu (float32, {threads} torch thread{'s' * (threads != 1)}) …"], err
    assert "Loading weights" not in err and "it/s" not in err


def _threads() -> int:
    import torch

    return torch.get_num_threads()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a glibc setting")
def test_large_blocks_go_back_to_the_os_under_glibc():
    assert return_large_blocks_to_the_os() is True


def test_the_offline_model_is_named_by_its_spec():
    assert _model_label(str(cache_home() / "models" / "gemma3-270m")) == "offline:gemma3-270m"
    assert _model_label("google/gemma-3-270m") == "hf:google/gemma-3-270m"


# ------------------------------------------------------------------------- timing in the trace (point 5)


class TimedReply(BaseChatModel):
    """A chat model whose reply metadata carries the given timing fields."""

    metadata: dict[str, Any]

    @property
    def _llm_type(self) -> str:
        return "test-timed"

    def _generate(self, messages, stop=None, run_manager=None, **kwargs) -> ChatResult:
        time.sleep(0.02)
        message = AIMessage(content="<answer>A</answer>", response_metadata=dict(self.metadata))
        return ChatResult(generations=[ChatGeneration(message=message)])


def _call(model: BaseChatModel) -> TraceEvent:
    _, event = call_agent(
        model,
        [HumanMessage(content="Q?")],
        lambda text: text,
        agent="respondent",
        node="respond",
        run_id="r1",
        sampling={"model": "test"},
    )
    return event


def test_call_agent_records_the_backends_queue_and_compute_split():
    event = _call(TimedReply(metadata={"queue_s": 1.5, "compute_s": 0.25}))
    assert (event.queue_s, event.compute_s) == (1.5, 0.25) and event.latency_s >= 0.02


@pytest.mark.parametrize(
    "metadata",
    [{}, {"compute_s": "fast"}, {"compute_s": float("nan")}, {"compute_s": -1}, {"queue_s": 2.0}],
    ids=["none", "text", "nan", "negative", "queue_only"],
)
def test_without_a_split_compute_is_the_wall_time_and_queue_unknown(metadata):
    event = _call(TimedReply(metadata=metadata))
    assert event.queue_s is None and event.compute_s == event.latency_s


def test_a_junk_queue_value_is_unknown_not_zero():
    assert call_timing({"compute_s": 0.5, "queue_s": "soon"}, 0.9) == (None, 0.5)


def test_hf_call_through_call_agent_lands_in_the_trace_store(tiny_path, tmp_path):
    model = HFChatModel(model_path=tiny_path, spec=f"hf:{tiny_path}", max_new_tokens=8)
    event = _call(model)
    assert event.queue_s is not None and 0 <= event.queue_s and 0 < event.compute_s <= event.latency_s
    store = TraceStore(tmp_path / "traces.sqlite")
    store.add_event(event)
    (row,) = store.events(run_id="r1")
    assert (row["queue_s"], row["compute_s"], row["latency_s"]) == (event.queue_s, event.compute_s, event.latency_s)


def _event(run_id: str, **timing: float | None) -> TraceEvent:
    return TraceEvent(
        run_id=run_id,
        node="respond",
        agent="respondent",
        model="m",
        sampling={},
        messages=[],
        completion="x",
        parsed=None,
        usage=None,
        logprobs=None,
        latency_s=1.0,
        **timing,
    )


def test_events_return_queue_and_compute_columns(tmp_path):
    store = TraceStore(tmp_path / "traces.sqlite")
    store.add_event(_event("r", queue_s=0.5, compute_s=0.25))
    store.add_event(_event("r", compute_s=1.0))  # a server backend: queue unknown
    rows = list(store.events(run_id="r"))
    assert [(r["queue_s"], r["compute_s"]) for r in rows] == [(0.5, 0.25), (None, 1.0)]


# The events and runs tables as the first version of the store wrote them (no inputs, no failed runs, no split).
OLD_SCHEMA = """
CREATE TABLE runs (run_id TEXT PRIMARY KEY, graph TEXT NOT NULL, question TEXT NOT NULL, gold TEXT, answer TEXT,
                   created_at REAL NOT NULL, finished_at REAL);
CREATE TABLE events (event_id TEXT PRIMARY KEY, run_id TEXT NOT NULL, seq INTEGER NOT NULL, node TEXT NOT NULL,
                     agent TEXT NOT NULL, model TEXT NOT NULL, sampling TEXT NOT NULL, messages TEXT NOT NULL,
                     completion TEXT NOT NULL, parsed TEXT, usage TEXT, logprobs TEXT, latency_s REAL NOT NULL,
                     gold TEXT, created_at REAL NOT NULL);
INSERT INTO runs VALUES ('old', 'cot', '{"question": "Q?"}', 'A', '{"answer": "A"}', 1.0, 2.0);
INSERT INTO events VALUES ('e0', 'old', 0, 'respond', 'respondent', 'm', '{}', '[]', 'A', '"A"', NULL, NULL, 3.5,
                           'A', 1.5);
"""


def test_an_old_store_gains_the_columns_and_its_rows_read_unknown(tmp_path):
    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as db:
        db.executescript(OLD_SCHEMA)
    store = TraceStore(path)
    (old,) = store.events(run_id="old")
    assert old["latency_s"] == 3.5 and old["queue_s"] is None and old["compute_s"] is None and old["inputs"] is None
    store.add_event(_event("old", queue_s=0.1, compute_s=0.2))
    reopened = TraceStore(path)  # a second open finds the columns there
    assert [(e["queue_s"], e["compute_s"]) for e in reopened.events(run_id="old")] == [(None, None), (0.1, 0.2)]
    assert reopened.run("old")["status"] == "finished"


# ------------------------------------------------------------------------------------- the real offline model


@pytest.mark.slow
def test_streamed_statistics_equal_the_full_logits_ones_on_the_offline_model():
    model = load_chat_model("offline:gemma3-270m")
    generator = hf_generator(model.model_path, model.device)
    chat = ["Name one bone of the hand.", "List three symptoms of anaemia, one per line.", "Hi"]
    prompts = [
        generator.tokenizer.apply_chat_template(
            [{"role": "user", "content": c}], tokenize=True, add_generation_prompt=True, return_dict=False
        )
        for c in chat
    ]
    for params in (
        GenerationParams(max_new_tokens=24),
        GenerationParams(max_new_tokens=24, stop=("\n",)),
        GenerationParams(max_new_tokens=24, temperature=0.8, top_p=0.95, seed=11),
    ):
        new = generator.generate_many([list(p) for p in prompts], params)
        assert_same_generation(new, reference_generate(generator, [list(p) for p in prompts], params))
        assert all(g.token_ids for g in new)


def test_scored_tokens_get_the_first_steps_exact_log_probabilities(tiny_generator):
    """Scoring option letters (`GenerationParams.scored_ids`): in a batch, each row's first-step log-probabilities of
    the asked ids equal a plain forward pass over that prompt alone."""
    import dataclasses

    import torch

    prompts = tiny_prompts(tiny_generator)
    ids = (5, 17, 300)
    out = tiny_generator.generate_many(prompts, dataclasses.replace(GREEDY, max_new_tokens=1, scored_ids=ids))
    for prompt, generated in zip(prompts, out):
        with torch.inference_mode():
            logits = tiny_generator.model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
        expected = torch.log_softmax(logits, dim=-1)[list(ids)].tolist()
        assert list(generated.first_scores) == list(ids)
        assert list(generated.first_scores.values()) == pytest.approx(expected, abs=1e-4)
    assert tiny_generator.generate(prompts[0], GREEDY).first_scores is None  # nothing asked, nothing scored


def test_the_chat_model_scores_single_token_texts_in_openais_shape(tiny_path):
    from langchain_core.messages import HumanMessage

    model = HFChatModel(model_path=tiny_path, spec=f"hf:{tiny_path}", max_new_tokens=1)
    reply = model.invoke([HumanMessage(content="Which letter?")], score_tokens=["A", "B", "not one token at all"])
    first = reply.response_metadata["logprobs"]["content"][0]
    assert [t["token"] for t in first["top_logprobs"]] == ["A", "B"]
    assert all(t["logprob"] < 0 for t in first["top_logprobs"])
    assert model.scores_answer_tokens()


def test_a_batch_decodes_in_the_order_of_its_prompts_whatever_order_the_calls_came_in(tiny_generator):
    """A fan-out's threads arrive in another order each run; sampled rows draw by their place in the batch."""
    prompts = fan_out_prompts(tiny_generator)
    forward = tiny_generator.generate_many(prompts, SAMPLED)
    backward = tiny_generator.generate_many(prompts[::-1], SAMPLED)[::-1]
    assert [g.token_ids for g in forward] == [g.token_ids for g in backward]
