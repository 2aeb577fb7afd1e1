"""Reward functions: GRPO rewards for the respondent, a ranking reward for the extractor's DPO pairs.

Every function here reads model output, which is untrusted: none of them raises on any completion string,
whatever its content or length (configuration errors, such as a negative weight, do raise, at build time).
Parsing is the agents' own: `agents.respondent.parse_answer` / `normalise_answer` and
`agents.extractor.parse_triplets`, so a reward sees a completion exactly as the graph does.

Respondent (GRPO). Plain callables with TRL's reward-function signature
`reward(completions, **kwargs) -> list[float]`; `GRPOTrainer` calls them as
`reward(prompts=..., completions=..., completion_ids=..., trainer_state=..., **dataset_columns)`. A completion
is a string (standard dataset) or a list of messages (conversational: the last assistant message is read).
Prompts are never read: the respondent's prompt holds an example `<answer>B</answer>`, which must not be
taken for the model's. Dataset columns used: `gold` (option key or free text), `options` (dict or None),
`triplets` (the evidence the respondent was shown: dicts with condition/relation/conclusion/snippet_id).

| reward | default weight | value |
|---|---|---|
| `well_formed_correctness_reward` | 1.0 | 1.0 if the completion is well formed and its answer equals `gold`, else 0.0 (`correctness_reward` without the format gate: `respondent_reward_funcs(correctness_requires_format=False)`) |
| `format_reward` | 0.5 | 1.0 well formed, else 0.0 (no partial credit: see below) |
| `length_penalty` | 0.2 | 0.0 up to `soft_chars`, linearly down to -`max_penalty` at `max_chars` and beyond |
| `evidence_use_reward` | 0.2 | 1.0 if correct and grounded in a triplet the reasoning refers to, else 0.0 |

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
- Length is counted in characters of the completion (`make_length_penalty(max_chars=1500,
  max_penalty=1.0, soft_chars=None)`; `soft_chars` defaults to two thirds of `max_chars`, i.e. 1000).
- Evidence use: 0.0 unless the answer is correct and `triplets` is non-empty. Then 1.0 when some triplet
  (a) supports the answer: the answer's content tokens (the chosen option's text, or the free-text answer)
  overlap the triplet's condition or conclusion, and (b) is referred to by the reasoning: the `<think>`
  text names the triplet's snippet id, or shares a content token with the triplet other than the answer's
  own tokens (restating the answer is not citing evidence).

Extractor (DPO ranking). `extractor_reward(completion, snippet, question=..., usefulness=...)` scores one
extraction and returns its named components (each in [0, 1]) and their weighted mean:

| component | default weight | value |
|---|---|---|
| `structure` | 0.3 | 1.0 strict JSON list with ≥1 complete triplet; 0.5 salvaged (truncated JSON, `a \\| b \\| c` lines); for a strict `[]`: 1.0 if the snippet shares no content token with the question, else 0.3; 0.0 unparseable or no usable triplet |
| `faithfulness` | 0.4 | share of the triplets' condition and conclusion content tokens found in the snippet, or `faithfulness_judge`; left out of `total` for an empty list (it makes no claim) |
| `conciseness` | 0.1 | 1.0 when the triplets' characters are ≤ 40% of the snippet's, linearly down to 0.0 at ≥ 100%; left out for an empty list |
| `usefulness` | 0.2 | given by the caller (did the respondent reach gold with this extraction); None: left out, weights renormalised |

Content tokens: lowercased alphanumeric runs, stop words removed, a light suffix-stripping stemmer
(`causes`, `caused`, `cause` → `caus`). Relations are not counted in faithfulness: the prompt asks for a
normalised connective ("causes", "treats", …) that need not be in the snippet's words.
"""

from __future__ import annotations

import logging
import math
import re
import string
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable

from ermedrag.agents.extractor import FIELDS, parse_triplets
from ermedrag.agents.respondent import normalise_answer, parse_answer

logger = logging.getLogger(__name__)

RewardFunc = Callable[..., list[float]]

FREE_TEXT_F1 = 0.8
YES_NO_MAYBE = frozenset({"yes", "no", "maybe"})
MAX_TEXT_CHARS = 200_000  # longer model output is cut before any scanning (bounded work)

# ---------------------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------------------


def completion_text(completion: Any) -> str:
    """The text of one completion: a string as is; for a list of messages (TRL's conversational format) the
    content of the last assistant message (content given as a list of parts: its text parts joined).
    Anything else gives "" rather than an error."""
    try:
        if completion is None:
            return ""
        if isinstance(completion, str):
            return completion
        if isinstance(completion, dict):
            return _content_text(completion.get("content"))
        if isinstance(completion, (list, tuple)):
            messages = [m for m in completion if isinstance(m, dict)]
            for message in reversed(messages):
                if message.get("role") == "assistant":
                    return _content_text(message.get("content"))
            return _content_text(messages[-1].get("content")) if messages else ""
    except Exception:  # a malformed message must not stop training
        logger.debug("unreadable completion of type %s", type(completion).__name__, exc_info=True)
    return ""


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": "..."}, ...]
        return "".join(
            str(part.get("text") or "") if isinstance(part, dict) else str(part) for part in content
        )
    return str(content)


STOP_WORDS = frozenset(
    """a about above after again against all also am an and any are as at be because been before being below
    between both but by can could did do does doing down during each either few for from further had has have
    having he her here hers him his how however i if in into is it its itself just may me might more most
    much must my no nor not of off on once only or other our out over own same she should so some such than
    that the their them then there these they this those through to too under until up very was we were
    what when where which while who whom why will with would yet you your
    answer following likely patient patients question shown which""".split()
)

_TOKEN = re.compile(r"[^\W_]+")
_SUFFIXES = (("ies", "y"), ("ments", ""), ("ment", ""), ("ing", ""), ("edly", ""), ("ed", ""), ("ly", ""),
             ("es", ""), ("s", ""))


def stem(token: str) -> str:
    """Strip one common English suffix, then a final "e" (so cause/causes/caused/causing agree)."""
    if len(token) <= 3 or token.isdigit():
        return token
    for suffix, replacement in _SUFFIXES:
        if token.endswith(suffix) and len(token) - len(suffix) >= 3:
            if suffix == "s" and token.endswith(("ss", "us", "is")):
                break
            token = token[: -len(suffix)] + replacement
            break
    return token[:-1] if len(token) > 3 and token.endswith("e") else token


def content_tokens(text: Any) -> list[str]:
    """Lowercased, stemmed alphanumeric tokens without stop words, in order (repeats kept)."""
    words = _TOKEN.findall(str(text or "")[:MAX_TEXT_CHARS].lower())
    return [stem(w) for w in words if w not in STOP_WORDS]


def _column(kwargs: dict[str, Any], name: str, index: int) -> Any:
    """Row `index` of a dataset column passed by the trainer, or None when absent or short."""
    values = kwargs.get(name)
    if values is None or isinstance(values, (str, bytes, dict)):
        return None
    try:
        return values[index] if index < len(values) else None
    except Exception:
        return None


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


# ---------------------------------------------------------------------------------------------------------
# Respondent rewards (GRPO)
# ---------------------------------------------------------------------------------------------------------

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


def _correct(parsed: dict[str, Any], kwargs: dict[str, Any], index: int) -> bool:
    options = _options(_column(kwargs, "options", index))
    return answer_matches(parsed.get("answer"), _gold(_column(kwargs, "gold", index)), options)


def correctness_reward(completions: list, **kwargs: Any) -> list[float]:
    """1.0 when the answer parsed from the completion (never the prompt) equals the row's `gold`, else 0.0."""
    rewards = []
    for i, completion in enumerate(completions):
        options = _options(_column(kwargs, "options", i))
        parsed = _parse(completion_text(completion), options)
        rewards.append(1.0 if _correct(parsed, kwargs, i) else 0.0)
    return rewards


def well_formed_correctness_reward(completions: list, **kwargs: Any) -> list[float]:
    """`correctness_reward`, but 0.0 for a completion that is not well formed (`is_well_formed`): during
    training an answer counts only in the trained format. Without this gate, sampled bare answers
    (`<answer>yes</answer>`) that happened to be right out-scored reasoning that the token budget cut
    short, and GRPO dropped the reasoning (benches/README, learning_signal)."""
    return [value if is_well_formed(completion_text(completion)) else 0.0
            for value, completion in zip(correctness_reward(completions, **kwargs), completions)]


def is_well_formed(text: str) -> bool:
    """Only whitespace outside one `<think>…</think>` followed by one non-blank `<answer>…</answer>`."""
    low = str(text or "")[:MAX_TEXT_CHARS].lower()
    tags = ("<think>", "</think>", "<answer>", "</answer>")
    if any(low.count(tag) != 1 for tag in tags):
        return False
    open_think, close_think, open_answer, close_answer = (low.index(tag) for tag in tags)
    if not open_think < close_think < open_answer < close_answer:
        return False
    outside = low[:open_think] + low[close_think + 8: open_answer] + low[close_answer + 9:]
    return not outside.strip() and bool(low[open_answer + 8: close_answer].strip())


def format_reward(completions: list, **kwargs: Any) -> list[float]:
    """1.0 well formed (`is_well_formed`), else 0.0."""
    return [1.0 if is_well_formed(completion_text(completion)) else 0.0 for completion in completions]


def make_length_penalty(max_chars: int = 1500, max_penalty: float = 1.0,
                        soft_chars: int | None = None) -> RewardFunc:
    """A reward function named `length_penalty`: 0.0 for completions up to `soft_chars` characters (default
    two thirds of `max_chars`), then falling linearly to `-max_penalty` at `max_chars`, and flat beyond."""
    soft = (2 * max_chars) // 3 if soft_chars is None else soft_chars
    if max_chars <= 0 or not 0 <= soft < max_chars or not max_penalty >= 0:
        raise ValueError(f"need 0 <= soft_chars < max_chars and max_penalty >= 0, got soft_chars={soft}, "
                         f"max_chars={max_chars}, max_penalty={max_penalty}")

    def length_penalty(completions: list, **kwargs: Any) -> list[float]:
        rewards = []
        for completion in completions:
            over = len(completion_text(completion)) - soft
            rewards.append(-max_penalty * min(1.0, over / (max_chars - soft)) if over > 0 else 0.0)
        return rewards

    length_penalty.__doc__ = (f"0.0 up to {soft} characters, linearly down to -{max_penalty} at {max_chars} "
                              f"characters and beyond.")
    return length_penalty


length_penalty = make_length_penalty()


def _triplets(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, (list, tuple)):
        return []
    rows = []
    for item in value[:64]:
        if isinstance(item, dict):
            rows.append({name: str(item.get(name) or "") for name in (*FIELDS, "snippet_id")})
    return rows


def _cites(reasoning: str, snippet_id: str) -> bool:
    sid = snippet_id.strip()
    return bool(sid) and re.search(rf"(?<![\w-]){re.escape(sid)}(?![\w-])", reasoning, re.IGNORECASE) is not None


def uses_evidence(parsed: dict[str, Any], options: dict[str, str] | None, triplets: list[dict[str, str]]) -> bool:
    """Some triplet supports the parsed answer and the reasoning refers to that triplet (module docstring)."""
    answer = parsed.get("answer")
    if answer is None:
        return False
    answer_text = options.get(answer, answer) if options else answer
    answer_tokens = set(content_tokens(answer_text))
    reasoning = str(parsed.get("reasoning") or "")
    reasoning_tokens = set(content_tokens(reasoning))
    for triplet in triplets:
        ends = set(content_tokens(triplet["condition"])) | set(content_tokens(triplet["conclusion"]))
        if not answer_tokens & ends:
            continue
        evidence = (ends | set(content_tokens(triplet["relation"]))) - answer_tokens
        if reasoning_tokens & evidence or _cites(reasoning, triplet["snippet_id"]):
            return True
    return False


def evidence_use_reward(completions: list, **kwargs: Any) -> list[float]:
    """1.0 when the answer is correct, a given triplet supports it and the reasoning refers to that triplet;
    0.0 otherwise, including rows without triplets."""
    rewards = []
    for i, completion in enumerate(completions):
        triplets = _triplets(_column(kwargs, "triplets", i))
        if not triplets:
            rewards.append(0.0)
            continue
        options = _options(_column(kwargs, "options", i))
        parsed = _parse(completion_text(completion), options)
        ok = _correct(parsed, kwargs, i) and uses_evidence(parsed, options, triplets)
        rewards.append(1.0 if ok else 0.0)
    return rewards


DEFAULT_RESPONDENT_WEIGHTS: dict[str, float] = {"correctness": 1.0, "format": 0.5, "length": 0.2, "evidence": 0.2}


def respondent_reward_funcs(weights: dict[str, float] | None = None, *, max_chars: int = 1500,
                            correctness_requires_format: bool = True) -> tuple[list[RewardFunc], list[float]]:
    """The respondent's reward functions and their weights, for `GRPOTrainer(reward_funcs=...)` and
    `GRPOConfig(reward_weights=...)`. `weights` overrides some of `DEFAULT_RESPONDENT_WEIGHTS` (keys
    correctness, format, length, evidence); `max_chars` sets the length penalty's hard limit. Correctness
    is `well_formed_correctness_reward` unless `correctness_requires_format` is False."""
    unknown = set(weights or {}) - set(DEFAULT_RESPONDENT_WEIGHTS)
    if unknown:
        raise ValueError(f"unknown reward weights {sorted(unknown)}; known: {sorted(DEFAULT_RESPONDENT_WEIGHTS)}")
    merged = {**DEFAULT_RESPONDENT_WEIGHTS, **(weights or {})}
    if any(not isinstance(w, (int, float)) or not math.isfinite(w) for w in merged.values()):
        raise ValueError(f"reward weights must be finite numbers, got {merged}")
    correctness = well_formed_correctness_reward if correctness_requires_format else correctness_reward
    funcs = {"correctness": correctness, "format": format_reward,
             "length": length_penalty if max_chars == 1500 else make_length_penalty(max_chars),
             "evidence": evidence_use_reward}
    return [funcs[name] for name in merged], [float(merged[name]) for name in merged]


# ---------------------------------------------------------------------------------------------------------
# Extractor reward (DPO ranking of alternative extractions)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExtractorRewardWeights:
    """Weights of the extractor reward's components; the total is their weighted mean."""

    structure: float = field(default=0.3, metadata={"help": "Weight of `structure`: a strict JSON triplet list "
                             "scores 1.0, a salvaged one 0.5, `[]` 1.0 on an irrelevant snippet (0.3 else)."})
    faithfulness: float = field(default=0.4, metadata={"help": "Weight of `faithfulness`: share of the "
                                "triplets' content tokens found in the snippet, or the judge's score."})
    conciseness: float = field(default=0.1, metadata={"help": "Weight of `conciseness`: 1.0 at ≤40% of the "
                               "snippet's characters, 0.0 at ≥100%."})
    usefulness: float = field(default=0.2, metadata={"help": "Weight of `usefulness`: whether the respondent "
                              "reached gold with this extraction; left out (renormalised) when not given."})

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"weight {f.name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class ExtractorReward:
    """One extraction's reward: components in [0, 1] (`usefulness` None when not given) and `total`, their
    mean weighted by `ExtractorRewardWeights` over the components present."""

    structure: float
    faithfulness: float
    conciseness: float
    usefulness: float | None
    total: float

    def as_dict(self) -> dict[str, float | None]:
        return asdict(self)


CONCISE_RATIO = 0.4  # triplet characters / snippet characters at or below which conciseness is 1.0
VERBOSE_RATIO = 1.0  # … at or above which it is 0.0
EMPTY_ON_RELEVANT = 0.3


def extractor_reward(
    completion: str,
    snippet: str,
    *,
    question: str = "",
    usefulness: float | None = None,
    weights: ExtractorRewardWeights | None = None,
    faithfulness_judge: Callable[[str, str], float] | None = None,
) -> ExtractorReward:
    """Score one extractor completion for `snippet` (see the module docstring for each component).

    `question` decides whether an empty list was right (no content token shared with the snippet) — pass
    it, or `[]` always counts as right. `faithfulness_judge(snippet, claim) -> [0, 1]`, when given, replaces
    token overlap: it is called once per triplet with the triplet as one sentence ("condition relation
    conclusion") and the scores are averaged — plug in an NLI model (premise=snippet, hypothesis=claim) or an
    LLM judge. A judge that raises or returns a non-number is logged and token overlap is used instead.
    """
    weights = weights or ExtractorRewardWeights()
    text = completion_text(completion)[:MAX_TEXT_CHARS]
    snippet = str(snippet or "")
    try:
        parsed = parse_triplets(text, "snippet")
    except Exception:  # parse_triplets is meant never to raise
        logger.warning("parse_triplets raised; scoring the extraction as unparseable", exc_info=True)
        parsed = {"triplets": [], "ok": False, "strict": False}
    triplets = [t for t in parsed.get("triplets") or [] if isinstance(t, dict)]

    structure = _structure(text, parsed, triplets, snippet, str(question or ""))
    faithfulness = _faithfulness(triplets, snippet, faithfulness_judge)
    conciseness = _conciseness(triplets, snippet)
    if usefulness is not None:
        try:
            usefulness = float(usefulness)
        except (TypeError, ValueError):
            usefulness = None
        usefulness = None if usefulness is None or math.isnan(usefulness) else min(1.0, max(0.0, usefulness))

    parts = [(weights.structure, structure)]
    if triplets:  # faithfulness and conciseness judge claims; an empty list makes none (else DPO learns
        # to prefer extracting irrelevant facts over a correct `[]`)
        parts += [(weights.faithfulness, faithfulness), (weights.conciseness, conciseness)]
    if usefulness is not None:
        parts.append((weights.usefulness, usefulness))
    weight_sum = sum(w for w, _ in parts)
    total = sum(w * v for w, v in parts) / weight_sum if weight_sum > 0 else 0.0
    return ExtractorReward(structure=structure, faithfulness=faithfulness, conciseness=conciseness,
                           usefulness=usefulness, total=total)


_FIELD_NAME = re.compile(r'"(condition|relation|conclusion)"', re.IGNORECASE)


def _structure(text: str, parsed: dict[str, Any], triplets: list[dict[str, Any]], snippet: str,
               question: str) -> float:
    if not parsed.get("ok"):
        return 0.0
    if triplets:
        return 1.0 if parsed.get("strict") else 0.5
    if parsed.get("strict") and not _FIELD_NAME.search(text):  # a deliberate `[]`, not a list of broken items
        relevant = set(content_tokens(snippet)) & set(content_tokens(question))
        return EMPTY_ON_RELEVANT if relevant else 1.0
    return 0.0


def _faithfulness(triplets: list[dict[str, Any]], snippet: str,
                  judge: Callable[[str, str], float] | None) -> float:
    if not triplets:
        return 0.0
    if judge is not None:
        try:
            claims = [" ".join(str(t.get(name) or "") for name in FIELDS) for t in triplets]
            scores = [float(judge(snippet, claim)) for claim in claims]
            if all(math.isfinite(s) for s in scores):
                return min(1.0, max(0.0, sum(scores) / len(scores)))
            logger.warning("faithfulness judge returned a non-finite score; using token overlap")
        except Exception:
            logger.warning("faithfulness judge failed; using token overlap", exc_info=True)
    claimed = [tok for t in triplets for name in ("condition", "conclusion") for tok in content_tokens(t.get(name))]
    if not claimed:
        return 0.0
    source = set(content_tokens(snippet))
    return sum(tok in source for tok in claimed) / len(claimed)


def _conciseness(triplets: list[dict[str, Any]], snippet: str) -> float:
    chars = sum(len(str(t.get(name) or "")) for t in triplets for name in FIELDS)
    if not chars:
        return 1.0
    if not snippet:
        return 0.0
    ratio = chars / len(snippet)
    if ratio <= CONCISE_RATIO:
        return 1.0
    return max(0.0, (VERBOSE_RATIO - ratio) / (VERBOSE_RATIO - CONCISE_RATIO))
