"""Which GRPO groups carry a learning signal, counted exactly.

A group whose completions all got the same reward has no advantage to follow. TRL logs the share of such groups as
`frac_reward_zero_std`, testing `isclose(std, 0)` with an absolute tolerance of 1e-8; but the std of equal float32
rewards whose sum is inexact (0.7 in a group of 8) is ~6e-8, so TRL counts such a silent group as one with a signal.
Equal rewards give a group bitwise-equal advantages (not zero ones: the mean's rounding remainder, divided by
std + 1e-4, reaches ~1e-3), so the exact test is a spread of advantages within a group.
"""

from __future__ import annotations

from typing import Any

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
    """`trl.GRPOTrainer` whose logged `frac_reward_zero_std` is the exact share of silent groups. In one training
    process only: with several, each holds a slice of the batch, and TRL's figure (over all of it) is kept."""

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        batch = super()._generate_and_score_completions(inputs)
        if self.model.training and self.accelerator.num_processes == 1:
            self._metrics["train"]["frac_reward_zero_std"][-1] = silent_group_share(batch, self.num_generations)
        return batch
