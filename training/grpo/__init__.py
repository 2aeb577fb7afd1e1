"""What GRPO training adds to TRL's trainer: rollouts that end at the agents' stop strings and search mid-generation
with the retrieved tokens masked (`rollouts`), and silent groups counted exactly with dynamic sampling (`sampling`)."""
