"""Training configurations: one dataclass per trainer, every field with a help string (TRL style).

A config is what a YAML file under `training/configs/` holds, flat, one key per field:

    cfg = load_config("training/configs/grpo_respondent.yaml", GRPOTrainingConfig)
    cfg = load_config("grpo_respondent", GRPOTrainingConfig)   # the same file by preset name, from any directory
    trl_args = cfg.to_trl()          # a trl.GRPOConfig

`DPOTrainingConfig` (the extractor), `SFTTrainingConfig` (the respondent's warm start on reference replies),
`GRPOTrainingConfig` (the respondent; rewards weighted by name,
`rewards: {correctness: 1.0, format: 0.5}`, see `training.rewards`), `MedR3TrainingConfig` (the three
Med-R³ stages, `training.med_r3`) and `MMedAgentTrainingConfig` (MMedAgent-RL's triage and curriculum stages,
`training.mmedagent`). The fields are the ones a run of this project changes; anything else TRL
offers goes in `trl_overrides` (checked against the TRL config's own fields, so a typo is an error, not a
silently ignored key). A key that an earlier version read (`reward_weights`) is an error that says what
replaces it.

Precision is automatic unless set: `bf16: null` means bf16 on a CUDA machine and float32 on CPU (TRL's own
default, bf16 everywhere, fails on CPU).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, TypeVar


OFFLINE_PREFIX = "offline:"
# The shipped configs (package data of `ermedrag.training`): `--config dpo_extractor` reads configs/dpo_extractor.yaml.
PRESETS_PACKAGE = "ermedrag.training"
PRESETS_FOLDER = "configs"

# Keys earlier versions read, with what replaces them.
REMOVED_KEYS = {
    "reward_weights": "weight rewards by name with rewards: {name: weight}, e.g. rewards: {correctness: 1.0, "
    "format: 0.5, length: 0.2, evidence: 0.2} (Med-R³: stage_overrides: {N: {rewards: {...}}})",
}

# Settings added after runs were recorded, with the value those runs trained with: left out of a config's settings
# while they keep it, so that a record written before them (a checkpoint, a finished seed) still matches.
ADDED_SETTINGS = {"resample_zero_variance_batches": 0, "entropy_bonus_on_silent_steps": True}


def comparable_settings(config: Any) -> dict[str, Any]:
    """A training config's fields for comparing with a record of another run (`ADDED_SETTINGS` at their value left
    out); a dict of settings around configs is returned as it is."""
    if not dataclasses.is_dataclass(config):
        return config
    return {
        name: value
        for name, value in dataclasses.asdict(config).items()
        if name not in ADDED_SETTINGS or value != ADDED_SETTINGS[name]
    }


def resolve_model(spec: str) -> str:
    """A model spec as the trainers accept it: a local path, a hub id, or `offline:<name>` (see tools.offline_model)."""
    if spec.startswith(OFFLINE_PREFIX):
        from ermedrag.tools.models.offline import offline_model_dir

        return str(offline_model_dir(spec[len(OFFLINE_PREFIX) :]))
    return spec


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    return torch.cuda.is_available()


@dataclass
class _TrainingConfig:
    """Fields shared by the DPO and GRPO configurations."""

    model: str = field(
        metadata={
            "help": "Policy model: a local folder, a Hugging Face hub id, or `offline:gemma3-270m` for the offline "
            "default (tools.offline_model). Loading by path lets TRL rebuild a reference model from it."
        },
    )
    dataset: str = field(
        metadata={
            "help": "Folder written by `datasets.Dataset.save_to_disk` (conversational TRL format). A DatasetDict "
            "folder is accepted; its `train` split is used."
        },
    )
    output_dir: str = field(
        metadata={"help": "Where checkpoints, the final adapter (or full model), `metrics.jsonl` and `curves.png` go."},
    )
    use_lora: bool = field(
        default=True,
        metadata={"help": "Train a LoRA adapter (PEFT) instead of the full model. The saved result is the adapter."},
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator (scale = lora_alpha / lora_r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA branch."})
    target_modules: str | list[str] = field(
        default="all-linear",
        metadata={
            "help": "Modules that get LoRA: `all-linear` (every linear layer but the output head) or a list of "
            "module names such as [q_proj, v_proj]."
        },
    )
    learning_rate: float = field(default=1e-5, metadata={"help": "Peak learning rate of AdamW."})
    max_steps: int = field(
        default=200,
        metadata={"help": "Number of optimizer steps. -1 means one pass over the dataset (`num_train_epochs`)."},
    )
    num_train_epochs: float = field(
        default=1.0, metadata={"help": "Epochs over the dataset; only used when `max_steps` is -1."}
    )
    per_device_train_batch_size: int = field(
        default=4,
        metadata={
            "help": "Per-device batch size. For GRPO this counts completions, not prompts: one prompt brings "
            "`num_generations` of them."
        },
    )
    gradient_accumulation_steps: int = field(
        default=1, metadata={"help": "Micro-batches accumulated before one optimizer step."}
    )
    warmup_steps: float = field(
        default=0,
        metadata={"help": "Linear LR warm-up: a step count, or a fraction in [0, 1) of the total steps."},
    )
    lr_scheduler_type: str = field(
        default="linear", metadata={"help": "transformers scheduler name (linear, cosine, constant...)."}
    )
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm."})
    bf16: bool | None = field(
        default=None,
        metadata={"help": "bf16 mixed precision. null = automatic: on when CUDA is available, off on CPU."},
    )
    dtype: str | None = field(
        default=None,
        metadata={
            "help": "dtype the weights are loaded in (float32, bfloat16, float16, auto). null = bfloat16 when bf16 "
            "is on, else float32."
        },
    )
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={"help": "Recompute activations to save memory. null = automatic: on with CUDA, off on CPU."},
    )
    seed: int = field(default=42, metadata={"help": "Random seed (model init of LoRA, data order, sampling)."})
    logging_steps: int = field(default=1, metadata={"help": "Log (and append to metrics.jsonl) every N steps."})
    save_steps: int = field(default=100, metadata={"help": "Write a checkpoint every N steps."})
    save_total_limit: int | None = field(
        default=2, metadata={"help": "Keep at most this many checkpoints (null = keep all)."}
    )
    resume: bool = field(
        default=False,
        metadata={
            "help": "Continue an interrupted run from the newest complete `checkpoint-N` in `output_dir` that was "
            "trained with these settings (optimizer, scheduler, RNG and step as they were; `metrics.jsonl` keeps the "
            "steps up to N; training.checkpoints). Without one, start from the beginning. Checkpoints come every "
            "`save_steps`. Not for staged runs (Med-R³, MMedAgent): rerun those from the stage that stopped."
        },
    )
    report_to: str | list[str] = field(
        default="none",
        metadata={"help": "Experiment trackers (wandb, tensorboard, trackio...). `none`: only metrics.jsonl."},
    )
    trl_overrides: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "Any other field of the TRL config, passed through as is (e.g. use_adaptive_entropy, "
            "entropy_target, top_p). Unknown names are an error."
        },
    )

    # --- derived values --------------------------------------------------------------------------------
    def resolved_bf16(self) -> bool:
        return cuda_available() if self.bf16 is None else bool(self.bf16)

    def resolved_dtype(self) -> str:
        if self.dtype is not None:
            return self.dtype
        return "bfloat16" if self.resolved_bf16() else "float32"

    def model_path(self) -> str:
        return resolve_model(self.model)

    def lora_config(self):
        """The peft.LoraConfig for this run, or None when LoRA is off."""
        if not self.use_lora:
            return None
        from peft import LoraConfig

        return LoraConfig(
            r=self.lora_r,
            lora_alpha=self.lora_alpha,
            lora_dropout=self.lora_dropout,
            target_modules=self.target_modules,
            task_type="CAUSAL_LM",
        )

    def _common_trl_kwargs(self) -> dict[str, Any]:
        on_cuda = cuda_available()
        bf16 = self.resolved_bf16()
        return {
            "output_dir": self.output_dir,
            "learning_rate": self.learning_rate,
            "max_steps": self.max_steps,
            "num_train_epochs": self.num_train_epochs,
            "per_device_train_batch_size": self.per_device_train_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "warmup_steps": int(self.warmup_steps) if self.warmup_steps >= 1 else self.warmup_steps,
            "lr_scheduler_type": self.lr_scheduler_type,
            "max_grad_norm": self.max_grad_norm,
            "bf16": bf16,
            "fp16": False,
            "use_cpu": not on_cuda,
            "gradient_checkpointing": on_cuda if self.gradient_checkpointing is None else self.gradient_checkpointing,
            "seed": self.seed,
            "logging_steps": self.logging_steps,
            "logging_strategy": "steps",
            "save_strategy": "steps",
            "save_steps": self.save_steps,
            "save_total_limit": self.save_total_limit,
            "report_to": self.report_to,
            "model_init_kwargs": {"dtype": self.resolved_dtype()},
        }

    def _build_trl(self, trl_cls, kwargs: dict[str, Any]):
        allowed = {f.name for f in dataclasses.fields(trl_cls) if f.init}
        unknown = sorted(set(self.trl_overrides) - allowed)
        if unknown:
            raise ValueError(f"trl_overrides has names that {trl_cls.__name__} does not know: {unknown}")
        return trl_cls(**{**kwargs, **self.trl_overrides})


@dataclass
class DPOTrainingConfig(_TrainingConfig):
    """DPO on preference pairs (the ER-MedRAG extractor: concise, informative triplets)."""

    beta: float = field(
        default=0.1,
        metadata={"help": "DPO temperature: how far the policy may move from the reference model (higher = closer)."},
    )
    loss_type: str | list[str] = field(
        default="sigmoid",
        metadata={"help": "DPO loss (sigmoid, ipo, hinge, robust, apo_zero, ...) or a list of them, see TRL docs."},
    )
    max_length: int | None = field(
        default=1024,
        metadata={"help": "Maximum tokens of prompt + completion; longer pairs are truncated (TRL keeps the start)."},
    )
    precompute_ref_log_probs: bool = field(
        default=False,
        metadata={
            "help": "Compute the reference log-probs once before training, so the reference model need not stay in "
            "memory (full fine-tuning only; with LoRA the reference is the base model with the adapter disabled)."
        },
    )

    def to_trl(self):
        """The trl.DPOConfig for this run."""
        from trl import DPOConfig

        kwargs = self._common_trl_kwargs()
        kwargs.update(
            beta=self.beta,
            loss_type=[self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type),
            max_length=self.max_length,
            precompute_ref_log_probs=self.precompute_ref_log_probs,
        )
        return self._build_trl(DPOConfig, kwargs)


@dataclass
class SFTTrainingConfig(_TrainingConfig):
    """Supervised warm start on reference replies (`reference_reply`: `ermedrag export grpo --questions` writes the
    respondent's, `ermedrag export mmedagent` the triage's): the agent learns the reply's shape and its answer (read
    off the evidence; the gold specialty) before GRPO, which needs groups whose samples sometimes get it right. The
    loss is on the reply only, never on the prompt."""

    learning_rate: float = field(default=2e-4, metadata={"help": "Peak learning rate of AdamW (LoRA's usual)."})
    max_steps: int = field(
        default=-1,
        metadata={"help": "Number of optimizer steps. -1 (the default) means `num_train_epochs` over the replies."},
    )
    max_length: int | None = field(
        default=1024,
        metadata={"help": "Maximum tokens of prompt + reply; a longer row is truncated (TRL keeps the start)."},
    )
    balance_answers: bool = field(
        default=False,
        metadata={
            "help": "Train on as many rows of each gold answer (the `gold` column; the rarest answer's count, rows "
            "in their order): replies that follow the data's prior teach it (96 PubMedQA-train replies, 55% yes, "
            "made the offline model answer yes to 42 of 48 balanced questions)."
        },
    )

    def to_trl(self):
        """The trl.SFTConfig for this run."""
        from trl import SFTConfig

        kwargs = self._common_trl_kwargs()
        kwargs.update(max_length=self.max_length, completion_only_loss=True, packing=False)
        return self._build_trl(SFTConfig, kwargs)


@dataclass
class GRPOTrainingConfig(_TrainingConfig):
    """GRPO on prompts with verifiable rewards (the ER-MedRAG respondent, Med-R³ stages, MMedAgent)."""

    beta: float = field(
        default=0.0,
        metadata={
            "help": "KL coefficient against the reference model. 0 (TRL's default) loads no reference model; > 0 "
            "needs the model by path (full fine-tuning) or LoRA (reference = adapter disabled)."
        },
    )
    num_generations: int = field(
        default=8,
        metadata={
            "help": "Completions sampled per prompt (the group). per_device_train_batch_size * "
            "gradient_accumulation_steps * processes must be divisible by it."
        },
    )
    max_completion_length: int = field(default=512, metadata={"help": "Maximum new tokens per completion."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature of the generations."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling threshold of the generations."})
    loss_type: str = field(
        default="dapo",
        metadata={"help": "GRPO loss normalisation: dapo (TRL default), grpo, dr_grpo, bnpo, cispo, sapo, ..."},
    )
    scale_rewards: str = field(
        default="group",
        metadata={"help": "Advantage scaling by the reward std: group, batch or none (Dr. GRPO)."},
    )
    resample_zero_variance_batches: int = field(
        default=0,
        metadata={
            "help": "Dynamic sampling (DAPO's, by whole batches; training.grpo): when every group of a "
            "step's generation batch got equal rewards, the step would teach nothing, so draw fresh training prompts "
            "up to this many times and train on the first batch with a signal. 0: off (TRL's behaviour)."
        },
    )
    entropy_bonus_on_silent_steps: bool = field(
        default=False,
        metadata={
            "help": "Apply the entropy bonus (entropy_coef) on a step whose groups all got equal rewards too "
            "(TRL's behaviour). false: the bonus acts only on steps with a reward signal; on a silent step it is "
            "the whole gradient, and Adam makes it a full-sized step whatever γ is (benches/README.md, triage "
            "entropy). One training process, a static γ only; with several, or adaptive entropy, TRL's rule."
        },
    )
    rewards: dict[str, float] | None = field(
        default=None,
        metadata={
            "help": "Reward weights by name (training.rewards.REWARDS: correctness, format, length, evidence, "
            "retrieval_hit, search_format, penalties), e.g. {correctness: 1.0, format: 0.5}. They update the "
            "defaults (null = the respondent's: correctness 1.0, format 0.5, length 0.2, evidence 0.2): a new "
            "name adds that reward, weight 0 drops one."
        },
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata={
            "help": "Leave completions cut at max_completion_length out of the loss. With "
            "vLLM, a completion that ended at a stop string has no EOS and counts as cut."
        },
    )
    use_vllm: bool = field(
        default=False, metadata={"help": "Generate with vLLM (GPU only; install vllm) instead of transformers."}
    )
    vllm_mode: str = field(
        default="colocate",
        metadata={
            "help": "`colocate`: vLLM runs inside each training process and shares its GPU; `server`: a separate "
            "`trl vllm-serve` process on its own GPU(s), reached at vllm_server_base_url."
        },
    )
    vllm_server_base_url: str | None = field(
        default=None,
        metadata={"help": "Base URL of the `trl vllm-serve` server (server mode), e.g. http://10.0.0.2:8000."},
    )
    vllm_gpu_memory_utilization: float = field(
        default=0.3, metadata={"help": "GPU memory fraction vLLM may take in colocate mode."}
    )
    log_completions: bool = field(
        default=False, metadata={"help": "Print a sample of prompts/completions/rewards at each logging step."}
    )
    stop_strings: list[str] = field(
        default_factory=lambda: ["</answer>"],
        metadata={
            "help": "A rollout ends at the first of these strings, which stays in the completion: the respondent "
            "stops at </answer> in the app, so it does in training (else it is graded on text the app never "
            "generates). transformers: a rollout function, which closes such a completion with EOS so TRL counts "
            "it terminated; vLLM: its stop list. [] = EOS or the length budget."
        },
    )

    def reward_settings(self) -> dict[str, Any]:
        """Parameters of the rewards that have some (`training.rewards`), by field name; none for the respondent."""
        return {}

    def to_trl(self, reward_weights: Sequence[float] | None = None):
        """The trl.GRPOConfig for this run; `reward_weights` in the order of the reward functions (None: all 1)."""
        from trl import GRPOConfig

        if self.vllm_mode not in ("colocate", "server"):
            raise ValueError(f"vllm_mode must be 'colocate' or 'server', got {self.vllm_mode!r}")
        if "reward_weights" in self.trl_overrides:
            raise ValueError(f"trl_overrides may not set reward_weights: {REMOVED_KEYS['reward_weights']}")
        kwargs = self._common_trl_kwargs()
        kwargs.update(
            beta=self.beta,
            num_generations=self.num_generations,
            max_completion_length=self.max_completion_length,
            temperature=self.temperature,
            top_p=self.top_p,
            loss_type=self.loss_type,
            scale_rewards=self.scale_rewards,
            reward_weights=list(reward_weights) if reward_weights is not None else None,
            mask_truncated_completions=self.mask_truncated_completions,
            use_vllm=self.use_vllm,
            vllm_mode=self.vllm_mode,
            vllm_server_base_url=self.vllm_server_base_url,
            vllm_gpu_memory_utilization=self.vllm_gpu_memory_utilization,
            log_completions=self.log_completions,
        )
        if self.use_vllm and self.stop_strings:
            kwargs["generation_kwargs"] = {"stop": list(self.stop_strings), "include_stop_str_in_output": True}
        return self._build_trl(GRPOConfig, kwargs)


C = TypeVar("C", bound=_TrainingConfig)


def config_from_dict(data: dict[str, Any], cls: type[C], *, source: str = "config") -> C:
    """Build `cls` from a flat mapping: unknown keys and missing required keys are errors naming them."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a mapping of field names to values, got {type(data).__name__}")
    not_names = [key for key in data if not isinstance(key, str)]
    if not_names:
        raise ValueError(f"{source}: keys must be field names, got {not_names}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    removed = sorted(set(data) & set(REMOVED_KEYS) - set(fields))
    if removed:
        raise ValueError(f"{source}: " + "; ".join(f"{key} is no longer a key: {REMOVED_KEYS[key]}" for key in removed))
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(
            f"{source}: unknown key(s) for {cls.__name__}: {unknown}. Valid keys: {sorted(fields)} "
            "(other TRL options go under trl_overrides)"
        )
    required = [
        name
        for name, f in fields.items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    missing = [name for name in required if name not in data]
    if missing:
        raise ValueError(f"{source}: missing required key(s) for {cls.__name__}: {missing}")
    hints = typing.get_type_hints(cls)
    values = {name: _coerce(value, hints[name], f"{source}: {name}") for name, value in data.items()}
    return cls(**values)


def presets() -> list[str]:
    """Names of the configs that ship with the package (`training/configs/*.yaml`, by stem). Found through the
    installed package (`importlib.resources`), not the working directory, so they load from anywhere."""
    folder = resources.files(PRESETS_PACKAGE).joinpath(PRESETS_FOLDER)
    if not folder.is_dir():  # pragma: no cover - the wheel ships them (tests/test_wheel.py)
        return []
    return sorted(entry.name.removesuffix(".yaml") for entry in folder.iterdir() if entry.name.endswith(".yaml"))


def _preset(spec: str | Path) -> Traversable | None:
    """The shipped YAML a spec names: `dpo_extractor`, `dpo_extractor.yaml`, or the repository path that docs and
    comments show (`training/configs/dpo_extractor.yaml`), which is not there outside a checkout. None otherwise."""
    path = Path(spec)
    if path.parent.parts not in ((), (".",), ("training", PRESETS_FOLDER)):
        return None
    name = path.name.removesuffix(".yaml")
    if name not in presets():
        return None
    return resources.files(PRESETS_PACKAGE).joinpath(PRESETS_FOLDER, f"{name}.yaml")


def load_config(path: str | Path, cls: type[C]) -> C:
    """Read a YAML file (a flat mapping of field names) into the config dataclass `cls`.

    `path` is a file, or a preset's name (`presets()`, e.g. `dpo_extractor`): an existing file wins, so a local
    `dpo_extractor` file is read as itself. Neither is one `FileNotFoundError` that lists the presets."""
    import yaml

    source: Path | Traversable = Path(path)
    if not Path(path).is_file():
        preset = _preset(path)
        if preset is None:
            raise FileNotFoundError(
                f"training config not found: {path} is neither a file nor a preset "
                f"(presets: {', '.join(presets()) or 'none installed'})"
            )
        source = preset
    with source.open("r", encoding="utf-8") as handle:
        try:
            data = yaml.safe_load(handle)
        except yaml.YAMLError as err:
            raise ValueError(f"{source}: not valid YAML: {' '.join(str(err).split())}") from None
    if data is None:
        data = {}
    return config_from_dict(data, cls, source=str(source))


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Check a YAML value against its field's type, fixing what PyYAML misreads: it reads `1e-5` (no dot) as a
    string; ints are fine as floats, and a whole float (`1e3`) as an int. Anything else wrong is an error naming
    the field, never a value that fails later (a string for a list would be taken letter by letter)."""
    if value is None:
        return None
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    kinds = {typing.get_origin(option) or option for option in options} - {type(None)}
    if kinds == {bool}:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true/false, got {value!r}")
        return value
    if float in kinds and not isinstance(value, bool) and isinstance(value, (int, str)):
        try:
            return float(value)
        except ValueError:
            if str in kinds:
                return value
            raise ValueError(f"{where}: expected a number, got {value!r}") from None
    if kinds == {float} and not isinstance(value, float):
        raise ValueError(f"{where}: expected a number, got {value!r}")
    if int in kinds:
        return _whole_number(value, where)
    if isinstance(value, str) and str in kinds:
        return value
    if list in kinds:
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            example = f" (one string is [{value!r}])" if isinstance(value, str) else ""
            raise ValueError(f"{where}: expected a list of strings{example}, got {value!r}")
        return value
    if dict in kinds:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping (key: value lines), got {value!r}")
        return value
    if kinds == {str}:
        raise ValueError(f"{where}: expected text, got {value!r}")
    return value


def _whole_number(value: Any, where: str) -> int:
    """An int field's value: an int, or a float or text that is a whole number (`1e3`); never a bool."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    try:
        number = float(value) if isinstance(value, (float, str)) else math.nan
    except ValueError:
        number = math.nan
    if not number.is_integer():
        raise ValueError(f"{where}: expected a whole number, got {value!r}")
    return int(number)
