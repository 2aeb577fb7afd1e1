"""GRPO rewards on the answer a completion gives: correctness, format, length, evidence use.

The respondent's rewards (ER-MedRAG) and, on the same terms, Med-R³'s answer rewards. Each reads the
model's own text (`training.reward_text.own_text`: for a completion without a search, the completion
itself; for a search transcript, what the model wrote without the inserted documents, so a retrieved
document can never supply an answer). None of them raises on any completion, whatever its content or length
(configuration errors, such as a negative length penalty, do raise, at build time). Parsing is the agents'
own: `agents.respondent.parse_answer` / `normalise_answer`, so a reward sees a completion exactly as the
graph does.

TRL's reward-function signature `reward(completions, **kwargs) -> list[float]`; `GRPOTrainer` calls them as
`reward(prompts=..., completions=..., completion_ids=..., trainer_state=..., **dataset_columns)`. Prompts are
never read: the respondent's prompt holds an example `<answer>B</answer>`, which must not be taken for the
model's. Dataset columns used: `gold` (option key or free text), `options` (dict or None), `triplets` (the
evidence the respondent was shown: dicts with condition/relation/conclusion/snippet_id).

| reward (curve name) | config name | value |
|---|---|---|
| `well_formed_correctness_reward` | correctness | 1.0 if the completion is well formed and its answer equals `gold`, else 0.0 |
| `format_reward` | format | 1.0 well formed, else 0.0 (no partial credit: see below) |
| `length_penalty` | length | 0.0 up to `soft_chars`, linearly down to -`max_penalty` at `max_chars` and beyond |
| `evidence_use_reward` | evidence | 1.0 if correct and the reasoning restates a relevant triplet, naming none but those |

`correctness_reward` (no format gate) is what evaluation counts; benches report it, training does not use it.
It reads a search rollout's `answer_text` (an answer the system had to ask for counts, as in the graph);
every other reward reads only what the model wrote, so a forced answer earns no format credit.

- Correct means: with options, the chosen option key equals the gold key (gold given as a key, an option's
  text or "(B)" is mapped to its key first); yes/no/maybe gold without options: the answer's first word;
  other free text: after lowercasing and stripping punctuation and articles, an exact match or a token F1
  of at least 0.8 (`FREE_TEXT_F1`).
- Well formed: nothing but whitespace outside exactly one `<think>…</think>` followed by exactly one
  `<answer>…</answer>` whose content is not blank (tags are case-insensitive; the reasoning may be empty).
  An unclosed `<answer>`, an "Answer: B" line, a bare `<answer>B</answer>`, a second answer or text after
  `</answer>` score 0.0, though the app's parser still reads an answer from them. A half credit for those
  was tried: GRPO on Gemma 3 270M dropped the reasoning within two steps and kept 7-token bare answers
  (benches/learning: well-formed rate 0.56 → 0), as a bare answer was never cut off by the token budget.
  The correctness reward is gated on it for the same reason: sampled bare answers that happened to be right
  out-scored reasoning that the token budget cut short.
- Length is counted in characters (`LengthPenalty(max_chars=1500, max_penalty=1.0, soft_chars=None)`;
  `soft_chars` defaults to two thirds of `max_chars`, i.e. 1000; Med-R³ sets `max_chars` from its config).
- Evidence use: 0.0 unless the answer is correct and `triplets` is non-empty. Then 1.0 when the reasoning (the
  `<think>` text) restates a triplet that is not a distractor (`distractor: true`, the export's noise from other
  runs), and every triplet it names is such a triplet and is restated by it. Restating means using the triplet's
  own content tokens, those that are neither the question's nor the answer's (restating the question or naming
  the answer is not using the evidence): at least `MIN_SHARED_TOKENS` (2), or `MIN_NAMED_TOKENS` (1) for a
  triplet the reasoning also names. Naming means citing its number in the evidence list ("evidence 2", "triplet
  #2", "fact 2", "[2]") or its snippet id. The rule asks nothing of the answer's wording, so it fires on
  yes/no/maybe questions too: an earlier rule asked the answer's tokens to appear in the triplet and never
  fired on PubMedQA (issue 15).
  A name must agree with what the reasoning says. An earlier rule paid a bare "Evidence 1": with a worked example
  that cites "Evidence 1", GRPO taught the 270M model to write "Evidence 1 says ..." in 48 of 48 held-out replies
  whatever line 1 held, mostly before another line's content, and the reward paid it whenever line 1 happened to
  be relevant (benches/learning, `learning_signal.py --grpo-example cites_number`). A reply that names a
  distractor scores 0.0 even when it also uses a relevant triplet: a third to a half of the base model's replies
  copied the number whatever it pointed at (`citation_example.py`). Setting a distractor aside by number
  ("evidence 1 is unrelated") is refused too: the rule cannot tell dismissing from relying, and a reply that
  uses the right evidence needs no distractor named.
"""

from __future__ import annotations

import logging
import re
import string
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ermedrag.agents.citations import cited_numbers
from ermedrag.agents.extractor import FIELDS
from ermedrag.agents.respondent import normalise_answer, parse_answer
from ermedrag.training.rewards.text import MAX_TEXT_CHARS, answer_source, column, content_tokens, own_text

logger = logging.getLogger(__name__)

FREE_TEXT_F1 = 0.8
YES_NO_MAYBE = frozenset({"yes", "no", "maybe"})

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans({ch: " " for ch in string.punctuation + "‘’“”–—…"})


def normalise_free_text(text: str) -> str:
    """SQuAD-style: lowercase, punctuation and articles removed, whitespace collapsed."""
    lowered = str(text or "")[:MAX_TEXT_CHARS].lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", lowered).split())


def token_f1(prediction: str, gold: str) -> float:
    """Token-level F1 of two already-normalised strings."""
    pred, ref = prediction.split(), gold.split()
    common = sum((Counter(pred) & Counter(ref)).values())
    if not pred or not ref or not common:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def gold_key(gold: str, options: dict[str, str]) -> str | None:
    """The option key a gold label names: the key itself, an option's exact text, or what the respondent's
    own `normalise_answer` makes of it ("(b)", "B. Insulin")."""
    if gold in options:
        return gold
    lowered = gold.strip(" .").lower()
    for key, text in options.items():
        if lowered == text.strip(" .").lower():
            return key
    return normalise_answer(gold, options)


def answer_matches(answer: str | None, gold: str | None, options: dict[str, str] | None) -> bool:
    """Whether a parsed answer (an option key with options, else free text) is the gold answer."""
    if answer is None or gold is None:
        return False
    if options:
        key = gold_key(gold, options)
        if key is not None:
            return answer == key
        chosen = options.get(answer)  # gold names no option: compare the chosen option's text to it
        return chosen is not None and _free_text_matches(chosen, gold)
    return _free_text_matches(answer, gold)


def _free_text_matches(answer: str, gold: str) -> bool:
    pred, ref = normalise_free_text(answer), normalise_free_text(gold)
    if not pred or not ref:
        return False
    if ref in YES_NO_MAYBE:
        return pred.split()[0] == ref
    return pred == ref or token_f1(pred, ref) >= FREE_TEXT_F1


def _options(value: Any) -> dict[str, str] | None:
    """An options dict without the None values a `datasets` struct column adds for keys other rows have."""
    if not isinstance(value, dict):
        return None
    options = {str(k): str(v) for k, v in value.items() if v is not None and str(v).strip()}
    return options or None


def _gold(value: Any) -> str | None:
    if value is None:
        return None
    text = str(value).strip()
    return text or None


def _parse(text: str, options: dict[str, str] | None) -> dict[str, Any]:
    try:
        return dict(parse_answer(text[:MAX_TEXT_CHARS], options))
    except Exception:  # parse_answer is meant never to raise; a reward must not depend on it
        logger.warning("parse_answer raised; scoring the completion as unanswered", exc_info=True)
        return {"answer": None, "reasoning": "", "ok": False, "well_formed": False, "error": "parser error"}


def _correct(parsed: dict[str, Any], kwargs: dict[str, Any], index: int) -> bool:
    options = _options(column(kwargs, "options", index))
    return answer_matches(parsed.get("answer"), _gold(column(kwargs, "gold", index)), options)


def _is_correct(text: str, kwargs: dict[str, Any], index: int) -> bool:
    return _correct(_parse(text, _options(column(kwargs, "options", index))), kwargs, index)


def correctness_reward(completions: list, **kwargs: Any) -> list[float]:
    """1.0 when the answer parsed from the completion (never the prompt) equals the row's `gold`, else 0.0."""
    return [1.0 if _is_correct(answer_source(c, kwargs, i), kwargs, i) else 0.0 for i, c in enumerate(completions)]


def well_formed_correctness_reward(completions: list, **kwargs: Any) -> list[float]:
    """`correctness_reward`, but 0.0 for a completion that is not well formed (`is_well_formed`): during
    training an answer counts only in the trained format (module docstring)."""
    rewards = []
    for i, completion in enumerate(completions):
        text = own_text(completion, kwargs, i)
        rewards.append(1.0 if _is_correct(text, kwargs, i) and is_well_formed(text) else 0.0)
    return rewards


def is_well_formed(text: str) -> bool:
    """Only whitespace outside one `<think>…</think>` followed by one non-blank `<answer>…</answer>`."""
    low = str(text or "")[:MAX_TEXT_CHARS].lower()
    tags = ("<think>", "</think>", "<answer>", "</answer>")
    if any(low.count(tag) != 1 for tag in tags):
        return False
    open_think, close_think, open_answer, close_answer = (low.index(tag) for tag in tags)
    if not open_think < close_think < open_answer < close_answer:
        return False
    outside = low[:open_think] + low[close_think + 8 : open_answer] + low[close_answer + 9 :]
    return not outside.strip() and bool(low[open_answer + 8 : close_answer].strip())


def format_reward(completions: list, **kwargs: Any) -> list[float]:
    """1.0 well formed (`is_well_formed`), else 0.0."""
    return [1.0 if is_well_formed(own_text(c, kwargs, i)) else 0.0 for i, c in enumerate(completions)]


@dataclass(frozen=True)
class LengthPenalty:
    """The reward `length_penalty`: 0.0 for completions up to `soft_chars` characters (default two thirds of
    `max_chars`), then falling linearly to `-max_penalty` at `max_chars`, and flat beyond."""

    max_chars: int = 1500
    max_penalty: float = 1.0
    soft_chars: int | None = None
    __name__ = "length_penalty"  # TRL's curve name; a class attribute, not a field

    def __post_init__(self) -> None:
        if self.max_chars <= 0 or not 0 <= self.soft < self.max_chars or not self.max_penalty >= 0:
            raise ValueError(
                f"need 0 <= soft_chars < max_chars and max_penalty >= 0, got soft_chars={self.soft}, "
                f"max_chars={self.max_chars}, max_penalty={self.max_penalty}"
            )

    @property
    def soft(self) -> int:
        return (2 * self.max_chars) // 3 if self.soft_chars is None else self.soft_chars

    def __call__(self, completions: list, **kwargs: Any) -> list[float]:
        rewards = []
        for i, completion in enumerate(completions):
            over = len(own_text(completion, kwargs, i)) - self.soft
            rewards.append(-self.max_penalty * min(1.0, over / (self.max_chars - self.soft)) if over > 0 else 0.0)
        return rewards


length_penalty = LengthPenalty()


def numbered_triplets(value: Any) -> list[dict[str, Any]]:
    """The evidence list, each triplet with the number the prompt showed it under (1-based; an item that is not a
    triplet keeps its place in the numbering), at most 64, each field a string."""
    if not isinstance(value, (list, tuple)):
        return []
    rows = []
    for number, item in enumerate(value[:64], 1):
        if isinstance(item, dict):
            rows.append(
                {
                    **{name: str(item.get(name) or "") for name in (*FIELDS, "snippet_id")},
                    "distractor": bool(item.get("distractor")),
                    "number": number,
                }
            )
    return rows


MIN_SHARED_TOKENS = 2  # one shared word is often a coincidence ("patient", "risk"); two rarely are
# A named triplet (its number or id) needs one of its own words beside the name: the name and a word together
# rarely coincide, while a name alone is what a model copies from its worked example whatever it points at.
MIN_NAMED_TOKENS = 1


def _cites(reasoning: str, snippet_id: str) -> bool:
    sid = snippet_id.strip()
    return bool(sid) and re.search(rf"(?<![\w-]){re.escape(sid)}(?![\w-])", reasoning, re.IGNORECASE) is not None


def _cited(triplet: dict[str, Any], numbers: list[int], reasoning: str) -> bool:
    """The reasoning names this triplet: its number in the evidence list or its snippet id."""
    return triplet["number"] in numbers or _cites(reasoning, triplet["snippet_id"])


@dataclass(frozen=True)
class Reference:
    """How a reasoning refers to one triplet of its evidence list: by name (number or snippet id) or not, and how
    many of the triplet's own words (not the question's, not the answer's) it uses."""

    triplet: dict[str, Any]
    named: bool
    shared_tokens: int

    @property
    def restated(self) -> bool:
        return self.shared_tokens >= (MIN_NAMED_TOKENS if self.named else MIN_SHARED_TOKENS)


def evidence_references(
    parsed: dict[str, Any], options: dict[str, str] | None, triplets: list[dict[str, Any]], question: str = ""
) -> list[Reference]:
    """Each triplet of `numbered_triplets` as the parsed reply's reasoning refers to it."""
    reasoning = str(parsed.get("reasoning") or "")
    answer = parsed.get("answer") or ""
    own = set(content_tokens(options.get(answer, answer) if options else answer)) | set(content_tokens(question))
    reasoning_tokens = set(content_tokens(reasoning))
    numbers = cited_numbers(reasoning)
    return [
        Reference(
            triplet,
            _cited(triplet, numbers, reasoning),
            len(reasoning_tokens & (set(content_tokens(" ".join(triplet[name] for name in FIELDS))) - own)),
        )
        for triplet in triplets
    ]


def uses_evidence(
    parsed: dict[str, Any], options: dict[str, str] | None, triplets: list[dict[str, Any]], question: str = ""
) -> bool:
    """The reasoning restates a triplet that is not a distractor, and every triplet it names (number or snippet id)
    is one of those and is restated by it (module docstring)."""
    if parsed.get("answer") is None:
        return False
    references = evidence_references(parsed, options, triplets, question)
    if any(ref.named and (ref.triplet["distractor"] or not ref.restated) for ref in references):
        return False
    return any(ref.restated and not ref.triplet["distractor"] for ref in references)


def evidence_use_reward(completions: list, **kwargs: Any) -> list[float]:
    """1.0 when the answer is correct and the reasoning refers to a triplet that is not a distractor and names no
    distractor; 0.0 otherwise, including rows without triplets."""
    rewards = []
    for i, completion in enumerate(completions):
        triplets = numbered_triplets(column(kwargs, "triplets", i))
        if not triplets:
            rewards.append(0.0)
            continue
        options = _options(column(kwargs, "options", i))
        parsed = _parse(own_text(completion, kwargs, i), options)
        question = str(column(kwargs, "question", i) or "")
        ok = _correct(parsed, kwargs, i) and uses_evidence(parsed, options, triplets, question)
        rewards.append(1.0 if ok else 0.0)
    return rewards
