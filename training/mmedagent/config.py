"""MMedAgent-RL's training configuration: triage, then the attending's curriculum (easy → medium → hard) or one stage on every bucket, each a GRPO config with its role's rewards, beta and entropy bonus."""

from __future__ import annotations
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from ermedrag.training.config import GRPOTrainingConfig


# Set by the MMedAgent stage schedule (`training.mmedagent`), so not settable through trl_overrides.
MMEDAGENT_SCHEDULED_TRL_FIELDS = ("beta", "entropy_coef", "use_adaptive_entropy", "entropy_target")


@dataclass
class MMedAgentTrainingConfig(GRPOTrainingConfig):
    """GRPO fields shared by the MMedAgent-RL stages (`training.mmedagent`): triage, then the attending's
    curriculum easy → medium → hard, each stage with its own entropy bonus and KL coefficient. `dataset` is the
    folder `ermedrag export mmedagent` wrote (triage/, easy/, medium/, hard/); `output_dir` holds one folder per
    stage. Per-stage values go in `stage_overrides.NAME`."""

    beta: float | None = field(
        default=None,
        metadata={
            "help": "KL coefficient for every stage; null = the schedule's (triage 1e-3, easy 1e-3, medium "
            "4e-3, hard 1e-2, attending 4e-3). stage_overrides.NAME.beta sets one stage."
        },
    )
    entropy_coef: float | None = field(
        default=None,
        metadata={
            "help": "Entropy bonus γ (loss - γ·mean token entropy, TRL's entropy_coef) for every stage; "
            "null = the schedule's (triage 0, easy 1e-4, medium 5e-3, hard 3e-2, attending 5e-3). "
            "stage_overrides.NAME.entropy_coef sets one stage."
        },
    )
    entropy_bonus: bool = field(
        default=True, metadata={"help": "false: γ = 0 in every stage (the ablation without the entropy bonus)."}
    )
    adaptive_entropy: bool = field(
        default=False,
        metadata={
            "help": "TRL's adaptive entropy controller (Skywork-OR1): γ starts at the stage's value and moves "
            "by entropy_coef_delta (trl_overrides) each step towards entropy_target."
        },
    )
    entropy_target: float | None = field(
        default=None, metadata={"help": "Target mean token entropy (nats) of the adaptive controller; null = TRL's."}
    )
    curriculum: bool = field(
        default=True,
        metadata={
            "help": "true: the attending trains easy → medium → hard, each stage from the previous one; "
            "false: one stage 'attending' on all buckets shuffled together (the ablation)."
        },
    )
    reward: str = field(
        default="paper",
        metadata={
            "help": "paper: 1·correct + 0.5·format (MMedAgent-RL); gated: the correct answer counts only in a "
            "well-formed reply (training.answer_rewards.well_formed_correctness_reward), + 0.5·format."
        },
    )
    attending_start: str | None = field(
        default=None,
        metadata={
            "help": "Model the attending's first stage starts from (path, hub id or offline:NAME); null = "
            "`model`. The triage stage always starts from `model`."
        },
    )
    stage_overrides: dict[str, dict[str, Any]] = field(
        default_factory=dict,
        metadata={
            "help": "Per stage (triage, easy, medium, hard, attending): fields of this config for that stage "
            "only (beta, entropy_coef, entropy_target, max_steps, learning_rate, dataset, "
            "max_completion_length, ...) and `rewards`: {name: weight} on top of the stage's defaults."
        },
    )

    def to_trl(self, reward_weights: Sequence[float] | None = None):
        """The trl.GRPOConfig of one stage: needs `beta` and `entropy_coef` resolved (`training.mmedagent.
        stage_config` does it)."""
        if self.beta is None or self.entropy_coef is None:
            raise ValueError(
                "MMedAgentTrainingConfig.to_trl needs a stage's config, with beta and entropy_coef "
                "set: use ermedrag.training.mmedagent.train.stage_config(config, STAGE)"
            )
        scheduled = sorted(set(self.trl_overrides) & set(MMEDAGENT_SCHEDULED_TRL_FIELDS))
        if scheduled:
            raise ValueError(
                f"trl_overrides may not set {scheduled}: use the config's beta, entropy_coef, "
                "adaptive_entropy, entropy_target (per stage under stage_overrides)"
            )
        coef = self.entropy_coef if self.entropy_bonus else 0.0
        # TRL's controller switches the bonus on by itself: a stage scheduled without one (triage) stays without.
        entropy: dict[str, Any] = {"entropy_coef": coef, "use_adaptive_entropy": self.adaptive_entropy and coef > 0}
        if self.entropy_target is not None:
            entropy["entropy_target"] = self.entropy_target
        with_entropy = dataclasses.replace(self, trl_overrides={**self.trl_overrides, **entropy})
        return GRPOTrainingConfig.to_trl(with_entropy, reward_weights)
