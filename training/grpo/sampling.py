"""GRPO beyond TRL's trainer: which groups carry a learning signal (counted exactly), and dynamic sampling.

Silent groups. A group whose completions all got the same reward has no advantage to follow. TRL logs the share of such groups as
`frac_reward_zero_std`, testing `isclose(std, 0)` with an absolute tolerance of 1e-8; but the std of equal float32
rewards whose sum is inexact (0.7 in a group of 8) is ~6e-8, so TRL counts such a silent group as one with a signal.
Equal rewards give a group bitwise-equal advantages (not zero ones: the mean's rounding remainder, divided by
std + 1e-4, reaches ~1e-3), so the exact test is a spread of advantages within a group.

Silent steps. When every group of a step's generation batch is silent, its loss is zero up to rounding (with `beta`
0 and no entropy bonus), but TRL still calls the optimizer, and Adam moves the weights by its momentum from the
last steps with a signal (and turns a rounding-sized gradient into a full-sized step): two steps with a signal then
kept sharpening the respondent's policy through 10 silent ones, its entropy falling from 0.5 to 0.04, until every
sample was the same reply (benches/README.md, evidence following). `SignalCountingGRPOTrainer` therefore holds such a
step: the gradients are dropped before `optimizer.step`, which leaves the weights and Adam's moments as they were
(`silent_steps_held` in the logs; one training process and `beta` 0 only).

The entropy bonus on silent steps. On a step without a reward signal the bonus (TRL's `entropy_coef`) is the whole
gradient but the KL term's, and Adam's first step has the same size whatever γ is: in the triage sweep, a first
silent step took every γ from 0.03 to 1 to one entropy and no reply was well formed after (benches/README.md,
triage entropy). Unless `entropy_bonus_on_silent_steps`, the trainer sets γ to 0 for such a step (logged as
`entropy_bonus_held`), so the bonus only widens a policy that rewards are moving, and with `beta` 0 the step is
held as above. One training process and a static γ only (the adaptive controller owns γ).

Dynamic sampling (as in DAPO), by whole generation batches. The share
of such groups is logged as `frac_reward_zero_std` (counted exactly, above); TRL trains on such a
batch anyway (dynamic sampling is not in its GRPOTrainer: huggingface/trl#3708). `ResamplingGRPOTrainer` samples a
fresh batch of training prompts instead, up to `resample_attempts` times, and trains on the first batch with a
signal (else on the last one drawn).

Whole batches, not single groups, are replaced, so TRL's batch tensors are used as it built them: with one prompt
per step (the respondent's recipe) that is exactly DAPO's rule; with several, a batch is resampled only when all of
its groups are silent. The logged training metrics describe the batch trained on; `resampled_batches` counts the
batches drawn and set aside in each step, and `step_time` includes their generation.
"""

from __future__ import annotations

import random
from typing import Any

from transformers import TrainerCallback
from trl import GRPOTrainer

# Advantages of rewards that differ are O(1) apart; equal rewards give a spread of exactly 0.
SIGNAL_TOLERANCE = 1e-6


def silent_group_share(batch: dict[str, Any], group_size: int) -> float:
    """The share of a scored generation batch's groups (rows in group order, as TRL scores them before it
    shuffles) whose completions' advantages are all equal; 1.0 for an empty batch."""
    groups = batch["advantages"].reshape(-1, group_size)
    if not groups.numel():
        return 1.0
    spread = groups.max(dim=1).values - groups.min(dim=1).values
    return float((spread <= SIGNAL_TOLERANCE).float().mean())


class SignalCountingGRPOTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` whose logged `frac_reward_zero_std` is the exact share of silent groups, and which holds
    the optimizer on a step whose generation batch is all silent (module docstring). In one training process only:
    with several, each holds a slice of the batch, and TRL's figure (over all of it) is kept."""

    def __init__(self, *args: Any, entropy_bonus_on_silent_steps: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batch_has_signal = True
        one_process = self.accelerator.num_processes == 1
        self.entropy_coef_with_signal = self.entropy_coef
        self.gates_entropy = (
            one_process
            and bool(self.entropy_coef)
            and not self.use_adaptive_entropy
            and not entropy_bonus_on_silent_steps
        )
        if one_process and not self.args.beta and (not self.entropy_coef or self.gates_entropy):
            self.add_callback(HoldSilentSteps(self))

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        batch = super()._generate_and_score_completions(inputs)
        if self.model.training and self.accelerator.num_processes == 1:
            share = silent_group_share(batch, self.num_generations)
            self._metrics["train"]["frac_reward_zero_std"][-1] = share
            self.batch_has_signal = share < 1.0
            if self.gates_entropy:  # TRL reads entropy_coef in each micro-batch's loss, after this
                self.entropy_coef = self.entropy_coef_with_signal if self.batch_has_signal else 0.0
                self._metrics["train"]["entropy_bonus_held"].append(float(not self.batch_has_signal))
        return batch


class HoldSilentSteps(TrainerCallback):
    """Drops the gradients of a step whose generation batch had no signal before the optimizer sees them: torch's
    optimizers skip a parameter without a gradient, so neither the weights nor Adam's moments move."""

    def __init__(self, trainer: SignalCountingGRPOTrainer) -> None:
        self.trainer = trainer

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        held = not self.trainer.batch_has_signal
        if held:
            for parameter in (model or self.trainer.model).parameters():
                parameter.grad = None
        self.trainer._metrics["train"]["silent_steps_held"].append(float(held))


class ResamplingGRPOTrainer(SignalCountingGRPOTrainer):
    """`trl.GRPOTrainer` (its silent groups counted exactly) that replaces a training generation batch without any
    reward variance by fresh prompts drawn from the training set (seeded by the run's seed, step and attempt, so a
    resumed run draws the same)."""

    def __init__(self, *args: Any, resample_attempts: int, **kwargs: Any) -> None:
        if resample_attempts < 0:  # before the model loads
            raise ValueError(f"resample_zero_variance_batches must be 0 or more, got {resample_attempts}")
        super().__init__(*args, **kwargs)
        if self.accelerator.num_processes > 1:  # each process would decide on its own slice of the batch
            raise ValueError("dynamic sampling (resample_zero_variance_batches) runs in one training process only")
        self.resample_attempts = resample_attempts

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        if not self.model.training or not self.resample_attempts:
            return super()._generate_and_score_completions(inputs)
        metrics = self._metrics["train"]
        attempt = 0
        while True:
            logged = {name: len(values) for name, values in metrics.items()}
            batch = super()._generate_and_score_completions(inputs)
            if metrics["frac_reward_zero_std"][-1] < 1.0 or attempt == self.resample_attempts:
                break
            for name, values in metrics.items():  # the set-aside batch's figures would describe no step
                del values[logged.get(name, 0) :]
            attempt += 1
            inputs = self._fresh_prompts(len(inputs), attempt)
        metrics["resampled_batches"].append(float(attempt))
        return batch

    def _fresh_prompts(self, rows: int, attempt: int) -> list[dict[str, Any]]:
        """As many training prompts as the batch had, each repeated once per completion of its group (the rows
        TRL's sampler gives)."""
        rng = random.Random(f"{self.args.seed}:{self.state.global_step}:{attempt}")
        picks = [rng.randrange(len(self.train_dataset)) for _ in range(rows // self.num_generations)]
        return [self.train_dataset[index] for index in picks for _ in range(self.num_generations)]
