"""Med-R³'s training configuration: three GRPO stages (reasoning, retrieval, joint), each a GRPO config with its stage's rewards and overrides."""

from __future__ import annotations
from dataclasses import dataclass, field
from typing import Any
from ermedrag.agents.reasoner import MAX_SEARCHES, STEP_MAX_NEW_TOKENS
from ermedrag.tools.retrieval.search import COARSE_K, SEARCH_K
from ermedrag.training.config import GRPOTrainingConfig


@dataclass
class MedR3TrainingConfig(GRPOTrainingConfig):
    """GRPO fields (shared by the stages) plus the search loop's and the stages' settings (`training.med_r3`).
    For Med-R³, `max_completion_length` is the number of tokens the model writes over all steps of one rollout
    (inserted documents are not counted) and `output_dir` holds one folder per stage. Rewards are weighted per
    stage: `stage_overrides.N.rewards`, not `rewards`."""

    index_dir: str | None = field(
        default=None, metadata={"help": "Corpus index (`ermedrag index`) searched in stages 2 and 3."}
    )
    chroma_url: str | None = field(default=None, metadata={"help": "Chroma server URL instead of the on-disk store."})
    search_k: int = field(default=SEARCH_K, metadata={"help": "Snippets returned per search (Med-R³: top 5)."})
    coarse_k: int = field(
        default=COARSE_K, metadata={"help": "Chunks kept by coarse hybrid retrieval before re-scoring."}
    )
    max_searches: int = field(default=MAX_SEARCHES, metadata={"help": "Searches per rollout (Med-R³: 4)."})
    step_max_new_tokens: int = field(
        default=STEP_MAX_NEW_TOKENS,
        metadata={"help": "Tokens of one generation step (until a search closes or the answer ends)."},
    )
    max_chars: int = field(
        default=3000,
        metadata={
            "help": "Model-written characters at which the length and overlong penalties are "
            "full; they start at two thirds of it."
        },
    )
    max_think_chars: int = field(
        default=2000, metadata={"help": "Characters of <think> content at which the think-length penalty is full."}
    )
    stage_overrides: dict[str, dict[str, Any]] = field(
        default_factory=dict,
        metadata={
            "help": "Per stage (1, 2, 3): fields of this config for that stage only (dataset, max_steps, "
            "learning_rate, num_generations, ...), and `rewards`: {name: weight} updating the stage's "
            "reward weights (names: correctness, format, length, retrieval_hit, search_format, "
            "penalties, evidence; weight 0 drops one)."
        },
    )

    def reward_settings(self) -> dict[str, Any]:
        return {"max_chars": self.max_chars, "max_think_chars": self.max_think_chars, "max_searches": self.max_searches}
