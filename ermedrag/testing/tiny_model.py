"""A tiny, randomly initialised causal LM with a real tokenizer, built offline in about a second.

Training-loop tests need a model that TRL can load *by path* (so a reference model can be rebuilt from it)
and a tokenizer with a chat template, pad and eos tokens. Nothing here touches the network: the tokenizer is a
byte-level BPE trained on a few hundred short medical-style sentences written below, and the model is a
2-layer Qwen2 built from a config.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

# ChatML, as Qwen2 uses it, without a default system prompt. `add_generation_prompt` opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAG_TOKENS = ["<think>", "</think>", "<answer>", "</answer>", "<search>", "</search>", "<document>", "</document>"]

_SUBJECTS = [
    "Metformin",
    "Aspirin",
    "Warfarin",
    "Insulin",
    "Amoxicillin",
    "Lisinopril",
    "Atorvastatin",
    "Heparin",
    "Furosemide",
    "Prednisone",
    "Levothyroxine",
    "Omeprazole",
    "Salbutamol",
    "Digoxin",
    "Vancomycin",
]
_EFFECTS = [
    "lowers blood glucose in type 2 diabetes",
    "inhibits platelet aggregation",
    "prolongs the INR",
    "treats diabetic ketoacidosis",
    "covers streptococcal pharyngitis",
    "reduces blood pressure",
    "lowers LDL cholesterol",
    "prevents venous thromboembolism",
    "relieves pulmonary oedema",
    "suppresses inflammation",
    "replaces thyroid hormone",
    "reduces gastric acid secretion",
    "relieves acute bronchospasm",
    "controls atrial fibrillation rate",
    "treats MRSA infection",
]
_PATIENTS = [
    "A 45-year-old man presents with chest pain radiating to the left arm.",
    "A 30-year-old woman reports fatigue, weight gain and cold intolerance.",
    "A 60-year-old smoker has a chronic productive cough and dyspnoea.",
    "A 25-year-old woman has fever, dysuria and flank pain.",
    "A 70-year-old man has sudden weakness of the right arm and slurred speech.",
    "A 5-year-old child has a barking cough and inspiratory stridor.",
    "A 55-year-old woman has polyuria, polydipsia and blurred vision.",
    "A 40-year-old man has epigastric pain relieved by meals.",
]
_QUESTIONS = [
    "What is the most likely diagnosis?",
    "Which drug is the first-line treatment?",
    "What is the next best step in management?",
    "Which laboratory test confirms the diagnosis?",
]


def training_sentences() -> list[str]:
    """A few hundred short medical-style sentences, with the reasoning/answer tags the project uses."""
    sentences = []
    for subject, effect in zip(_SUBJECTS, _EFFECTS):
        sentences.append(f"{subject} {effect}.")
        sentences.append(f"Condition: patient needs therapy; relation: {subject} {effect}; conclusion: give {subject}.")
    for patient, question in itertools.product(_PATIENTS, _QUESTIONS):
        sentences.append(f"{patient} {question}")
        sentences.append(f"Question: {patient} {question} Options: A) one B) two C) three D) four")
    for i, (subject, effect) in enumerate(itertools.product(_SUBJECTS, _EFFECTS[:6])):
        letter = "ABCD"[i % 4]
        sentences.append(
            f"<think>The evidence says {subject} {effect}. The answer is {letter}.</think><answer>{letter}</answer>"
        )
    return sentences


def build_tokenizer(vocab_size: int = 768):
    """Train a byte-level BPE tokenizer and wrap it as a transformers fast tokenizer with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(training_sentences(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_input_names=["input_ids", "attention_mask"],
    )
    # Tags are ordinary (non-special) tokens: decoding with skip_special_tokens=True must keep them.
    tokenizer.add_tokens(TAG_TOKENS)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer


def qwen2_for(
    tokenizer: Any, *, vocab_size: int | None = None, max_position_embeddings: int = 512, **shape: int
) -> tuple[Any, Any]:
    """A Qwen2 config of the given shape around `tokenizer` (its ids for eos and pad, no bos), and a sampling
    generation config that stops at its eos: what every randomly initialised test model here is built from."""
    from transformers import GenerationConfig, Qwen2Config

    config = Qwen2Config(
        vocab_size=vocab_size or len(tokenizer),
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **shape,
    )
    config.architectures = ["Qwen2ForCausalLM"]
    generation = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=True
    )
    return config, generation


def build_tiny_causal_lm(directory: str | Path, *, seed: int = 0) -> str:
    """Write a tiny Qwen2 causal LM and its tokenizer to `directory`; return the path as a string."""
    import torch
    from transformers import Qwen2ForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config, generation = qwen2_for(
        tokenizer,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = generation
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)
