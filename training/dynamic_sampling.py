"""Dynamic sampling for GRPO (as in DAPO), by whole generation batches.

A GRPO group whose completions all got the same reward has no advantage to follow; when every group of a step's
generation batch is like that, the step changes nothing (with `beta` 0 the loss is zero up to rounding). The share
of such groups is logged as `frac_reward_zero_std` (counted exactly: `training.grpo_signal`); TRL trains on such a
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

from ermedrag.training.grpo_signal import SignalCountingGRPOTrainer


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
                del values[logged.get(name, 0):]
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
