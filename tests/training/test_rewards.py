"""Reward functions: hand-written cases for each reward, TRL's calling convention, and random text."""

from __future__ import annotations

import inspect
import json
import math
import pickle
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ermedrag.agents.respondent import EXAMPLE, parse_answer
from ermedrag.agents.respondent import example as example_turns
from ermedrag.training.rewards.answers import (
    LengthPenalty,
    correctness_reward,
    evidence_use_reward,
    format_reward,
    length_penalty,
    well_formed_correctness_reward,
)
from ermedrag.training.rewards.extraction import ExtractorReward, ExtractorRewardWeights, extractor_reward
from ermedrag.training.rewards.text import completion_text, content_tokens
from ermedrag.training.rewards import REWARDS, RESPONDENT_REWARDS, resolve_rewards

OPTIONS = {"A": "Vitamin C", "B": "Vitamin D", "C": "Vitamin B12"}
TRIPLETS = [
    {
        "condition": "vitamin D deficiency in children",
        "relation": "causes",
        "conclusion": "rickets with bowed legs",
        "snippet_id": "kb-7",
    }
]
GOOD = (
    "<think>Bowed legs and poor mineralisation mean rickets, caused by vitamin D deficiency.</think><answer>B</answer>"
)


def cols(n: int = 1, gold: str = "B", options: dict | None = OPTIONS, triplets: list | None = None) -> dict:
    """Dataset columns as GRPOTrainer passes them: one list entry per completion."""
    columns = {"gold": [gold] * n, "options": [options] * n}
    if triplets is not None:
        columns["triplets"] = [triplets] * n
    return columns


def score(fn, completion: str, **columns) -> float:
    return fn([completion], **(columns or cols()))[0]


# --- completion_text -----------------------------------------------------------------------------------


def test_completion_text_reads_strings_and_the_last_assistant_message():
    assert completion_text("plain") == "plain"
    assert completion_text([{"role": "assistant", "content": "x"}]) == "x"
    turns = [
        {"role": "assistant", "content": "first"},
        {"role": "tool", "content": "doc"},
        {"role": "assistant", "content": [{"type": "text", "text": "sec"}, {"type": "text", "text": "ond"}]},
    ]
    assert completion_text(turns) == "second"
    assert completion_text(None) == "" and completion_text([]) == "" and completion_text(42) == ""
    assert completion_text([{"role": "assistant"}]) == ""


# --- correctness ---------------------------------------------------------------------------------------


def test_correct_well_formed_answer_scores_one_and_wrong_answer_zero():
    assert score(correctness_reward, GOOD) == 1.0
    assert score(correctness_reward, GOOD.replace(">B<", ">A<")) == 0.0
    assert score(correctness_reward, "<think>x</think><answer>(b) Vitamin D</answer>") == 1.0
    assert score(correctness_reward, "<think>x</think><answer>Vitamin D</answer>") == 1.0
    assert score(correctness_reward, "<think>x</think><answer>E</answer>") == 0.0  # no such option


def test_gold_given_as_option_text_is_mapped_to_its_key():
    assert score(correctness_reward, GOOD, **cols(gold="vitamin d")) == 1.0
    assert score(correctness_reward, GOOD, **cols(gold="(B)")) == 1.0


def test_answer_only_in_the_prompt_scores_zero():
    """The respondent prompt carries an example answer (`<answer>B</answer>` here): it must never count as the
    model's."""
    example = next(
        e
        for e in (example_turns(f"Question {i}", {"A": "x", "B": "y", "C": "z"}) for i in range(50))
        if "<answer>B</answer>" in e[1]
    )
    prompt = [
        {"role": "system", "content": "..."},
        {"role": "user", "content": example[0]},
        {"role": "assistant", "content": example[1]},
        {"role": "user", "content": "Question: ..."},
    ]
    completion = [{"role": "assistant", "content": "<think>It is probably vitamin D.</think>"}]
    for fn in (correctness_reward, format_reward, evidence_use_reward):
        assert fn(prompts=[prompt], completions=[completion], **cols(triplets=TRIPLETS)) == [0.0]
    assert correctness_reward(prompts=["<answer>B</answer>"], completions=["I am not sure."], **cols()) == [0.0]


def test_free_text_gold_exact_after_normalisation_or_token_f1():
    free = cols(gold="The vitamin D receptor", options=None)
    assert score(correctness_reward, "<think>x</think><answer>vitamin-D receptor.</answer>", **free) == 1.0
    long_gold = cols(gold="early broad spectrum antibiotics and fluids", options=None)
    near = "<think>x</think><answer>early broad spectrum antibiotics, IV fluids</answer>"  # F1 ≈ 0.83
    assert score(correctness_reward, near, **long_gold) == 1.0
    assert score(correctness_reward, "<think>x</think><answer>antibiotics</answer>", **long_gold) == 0.0
    assert score(correctness_reward, "<think>x</think><answer>insulin</answer>", **free) == 0.0


def test_yes_no_maybe_with_and_without_options():
    yes_no = {"A": "yes", "B": "no", "C": "maybe"}
    assert score(correctness_reward, "<think>x</think><answer>no</answer>", **cols(gold="B", options=yes_no)) == 1.0
    assert score(correctness_reward, "<think>x</think><answer>yes</answer>", **cols(gold="B", options=yes_no)) == 0.0
    free = cols(gold="yes", options=None)
    assert score(correctness_reward, "<think>x</think><answer>Yes, it does.</answer>", **free) == 1.0
    assert score(correctness_reward, "<think>x</think><answer>No.</answer>", **free) == 0.0


def test_missing_gold_or_columns_score_zero_without_raising():
    assert correctness_reward([GOOD, GOOD]) == [0.0, 0.0]
    assert correctness_reward([GOOD, GOOD], gold=["B"], options=[OPTIONS]) == [1.0, 0.0]  # short column
    assert correctness_reward([GOOD], gold=[None], options=[None]) == [0.0]


def test_options_struct_column_with_none_values_from_datasets():
    """`datasets` stores dict columns as structs: keys missing in a row come back as None."""
    padded = {"A": "Vitamin C", "B": "Vitamin D", "C": "Vitamin B12", "D": None, "E": None}
    assert score(correctness_reward, GOOD, **cols(options=padded)) == 1.0
    assert score(correctness_reward, "<think>x</think><answer>D</answer>", **cols(gold="D", options=padded)) == 0.0


# --- format --------------------------------------------------------------------------------------------


def test_format_well_formed_scores_one():
    assert score(format_reward, GOOD) == 1.0
    assert score(format_reward, "  <THINK>\n</THINK>\n<Answer> B </Answer>\n") == 1.0  # empty reasoning is allowed


@pytest.mark.parametrize(
    "completion",
    [
        "<think>a</think><answer>B</answer><answer>B</answer>",  # two answers
        "<think>a</think><answer>B</answer> because vitamin D.",  # text after the answer
        "<answer>B</answer>",  # no reasoning block
        "<answer>B</answer><think>a</think>",  # wrong order
        "<think>a</think><think>b</think><answer>B</answer>",  # two reasoning blocks
        "Sure. <think>a</think><answer>B</answer>",  # text before
        "<think>a</think> so: <answer>B</answer>",  # text between
        "<think>a</think><answer>B",  # unclosed (stopped at the stop string)
        "<think>a</think>Final answer: B",  # lenient form
    ],
)
def test_format_off_scores_zero_even_when_an_answer_parses(completion):
    assert parse_answer(completion)["ok"]
    assert score(format_reward, completion) == 0.0


@pytest.mark.parametrize(
    "completion",
    [
        "",
        "   ",
        "<think>no answer at all</think>",
        "<think>a</think><answer>  </answer>",
        "<think>a</think><answer>Z</answer>junk",
    ],
)
def test_format_without_a_readable_answer_scores_zero(completion):
    assert score(format_reward, completion) == 0.0


def test_two_answers_and_trailing_text_are_still_judged_on_the_first_answer_for_correctness():
    assert score(correctness_reward, "<think>a</think><answer>B</answer><answer>A</answer>") == 1.0
    assert score(correctness_reward, "<think>a</think><answer>B</answer> or maybe A") == 1.0


def test_training_correctness_counts_only_well_formed_answers():
    bare, unclosed_think = "<answer>B</answer>", "<think>rickets fits\n<answer>B</answer>"
    assert [score(correctness_reward, c) for c in (GOOD, bare, unclosed_think)] == [1.0, 1.0, 1.0]
    assert [score(well_formed_correctness_reward, c) for c in (GOOD, bare, unclosed_think)] == [1.0, 0.0, 0.0]
    assert score(well_formed_correctness_reward, GOOD.replace(">B<", ">A<")) == 0.0


# --- length penalty ------------------------------------------------------------------------------------


def test_length_penalty_thresholds():
    fn = LengthPenalty(max_chars=1500, max_penalty=1.0)  # soft limit 1000
    assert fn.__name__ == "length_penalty"
    values = fn(["x" * n for n in (0, 999, 1000, 1250, 1500, 10_000)])
    assert values[:3] == [0.0, 0.0, 0.0]
    assert values[3] == pytest.approx(-0.5) and values[4] == pytest.approx(-1.0) and values[5] == pytest.approx(-1.0)
    custom = LengthPenalty(max_chars=200, max_penalty=0.5, soft_chars=100)
    assert custom(["x" * 150, [{"role": "assistant", "content": "x" * 300}]]) == [pytest.approx(-0.25), -0.5]
    assert length_penalty(["short"]) == [0.0]
    for bad in ({"max_chars": 0}, {"max_chars": 100, "soft_chars": 100}, {"max_penalty": -1.0}):
        with pytest.raises(ValueError):
            LengthPenalty(**bad)


# --- evidence use --------------------------------------------------------------------------------------


def test_evidence_use_positive_when_correct_supported_and_cited():
    columns = cols(triplets=TRIPLETS)
    assert score(evidence_use_reward, GOOD, **columns) == 1.0
    by_id = "<think>Per [kb-7], rickets: option B.</think><answer>B</answer>"
    assert score(evidence_use_reward, by_id, **columns) == 1.0
    assert score(evidence_use_reward, by_id.replace(", rickets", ""), **columns) == 0.0  # a bare name, nothing used


def test_evidence_use_negative_cases():
    columns = cols(triplets=TRIPLETS)
    restated = "<think>I just know it is vitamin D.</think><answer>B</answer>"  # names only the answer
    assert score(evidence_use_reward, restated, **columns) == 0.0
    wrong = GOOD.replace(">B<", ">A<")  # cites the evidence but answers wrongly
    assert score(evidence_use_reward, wrong, **columns) == 0.0
    unrelated = [{"condition": "sepsis", "relation": "treated with", "conclusion": "antibiotics", "snippet_id": "s2"}]
    assert score(evidence_use_reward, GOOD, **cols(triplets=unrelated)) == 0.0  # no triplet supports vitamin D
    assert score(evidence_use_reward, GOOD, **cols(triplets=[])) == 0.0
    assert score(evidence_use_reward, GOOD, **cols()) == 0.0  # no triplets column at all


def test_evidence_use_on_free_text_answers():
    columns = cols(gold="rickets", options=None, triplets=TRIPLETS)
    good = "<think>Vitamin D deficiency in children causes it.</think><answer>Rickets</answer>"
    assert score(evidence_use_reward, good, **columns) == 1.0
    assert score(evidence_use_reward, "<think>Classic.</think><answer>Rickets</answer>", **columns) == 0.0


# Evidence lists as the export writes them: the run's own triplets and distractors from other runs, shuffled,
# numbered 1.. in the prompt.
YES_NO_QUESTION = "Does metformin use lower the risk of lactic acidosis in patients with renal impairment?"
YES_NO_TRIPLETS = [
    {
        "condition": "sepsis",
        "relation": "treated with",
        "conclusion": "broad-spectrum antibiotics",
        "snippet_id": "pubmed-9@0-80",
        "distractor": True,
    },
    {
        "condition": "metformin in patients with reduced eGFR",
        "relation": "associated with",
        "conclusion": "higher incidence of lactic acidosis",
        "snippet_id": "pubmed-1@0-120",
        "distractor": False,
    },
]


def yes_no_cols(**extra) -> dict:
    return {"gold": ["no"], "options": [None], "question": [YES_NO_QUESTION], "triplets": [YES_NO_TRIPLETS], **extra}


def test_evidence_use_fires_on_yes_no_questions_when_the_reasoning_uses_a_triplet():
    restates = "<think>Reduced eGFR showed a higher incidence with metformin, so it does not lower it.</think><answer>no</answer>"
    by_number = "<think>Evidence 2 says the opposite: a higher incidence.</think><answer>no</answer>"
    by_bracket = "<think>As [2] reports for reduced eGFR, it does not.</think><answer>no</answer>"
    by_id = "<think>pubmed-1@0-120 reports a higher incidence.</think><answer>no</answer>"
    for completion in (restates, by_number, by_bracket, by_id):
        assert score(evidence_use_reward, completion, **yes_no_cols()) == 1.0, completion
    assert score(evidence_use_reward, restates.replace(">no<", ">yes<"), **yes_no_cols()) == 0.0  # wrong answer


def test_evidence_use_ignores_distractors_and_restated_questions():
    distractor_by_number = "<think>Evidence 1 settles it.</think><answer>no</answer>"
    distractor_content = "<think>Sepsis needs broad-spectrum antibiotics, so no.</think><answer>no</answer>"
    question_only = "<think>Metformin, lactic acidosis, renal impairment: no.</think><answer>no</answer>"
    unnumbered = "<think>In 2 weeks of use nothing changes.</think><answer>no</answer>"  # a number is not a citation
    own_points = "<think>Point 2: it does not. Finding 2: no.</think><answer>no</answer>"  # its own list, not ours
    for completion in (distractor_by_number, distractor_content, question_only, unnumbered, own_points):
        assert score(evidence_use_reward, completion, **yes_no_cols()) == 0.0, completion


def test_evidence_use_refuses_a_reply_that_names_a_distractor_beside_the_evidence():
    # copying a worked example's "Evidence 1" must not pay when 1 is a distractor (benches citation_example)
    for completion in (
        "<think>Evidence 1 and evidence 2 say so.</think><answer>no</answer>",
        "<think>[1] is unrelated; [2] reports the opposite.</think><answer>no</answer>",
        "<think>pubmed-9@0-80 and evidence 2 agree.</think><answer>no</answer>",
        "<think>Reduced eGFR showed a higher incidence (Evidence 1).</think><answer>no</answer>",
    ):
        assert score(evidence_use_reward, completion, **yes_no_cols()) == 0.0, completion
    # naming only the relevant one still pays, with the distractor listed first or second
    says = "<think>Evidence {} says the incidence is higher.</think><answer>no</answer>"
    assert score(evidence_use_reward, says.format(2), **yes_no_cols()) == 1.0
    swapped = yes_no_cols(triplets=[list(reversed(YES_NO_TRIPLETS))])
    assert score(evidence_use_reward, says.format(1), **swapped) == 1.0
    assert score(evidence_use_reward, says.format(2), **swapped) == 0.0


def test_evidence_use_refuses_a_name_that_does_not_agree_with_what_the_reasoning_says():
    # GRPO with a worked example citing "Evidence 1" taught the model to write "Evidence 1 says" before whatever
    # it restated: a name pays only beside the named triplet's own words
    relevant_first = yes_no_cols(
        triplets=[
            [
                {
                    "condition": "metformin in chronic kidney disease",
                    "relation": "associated with",
                    "conclusion": "stable bicarbonate levels",
                    "snippet_id": "pubmed-3@0-90",
                    "distractor": False,
                },
                *reversed(YES_NO_TRIPLETS),
            ]
        ]
    )
    mislabelled = "<think>Evidence 1 says reduced eGFR showed a higher incidence.</think><answer>no</answer>"
    assert score(evidence_use_reward, mislabelled, **relevant_first) == 0.0  # line 2's words under line 1's name
    assert score(evidence_use_reward, mislabelled.replace("Evidence 1", "Evidence 2"), **relevant_first) == 1.0
    assert score(evidence_use_reward, mislabelled.replace("Evidence 1 says ", ""), **relevant_first) == 1.0
    assert score(evidence_use_reward, "<think>Evidence 1 says so.</think><answer>no</answer>", **relevant_first) == 0.0


def test_evidence_numbers_are_the_prompts_even_after_an_item_that_is_not_a_triplet():
    shown = ["not a triplet", *YES_NO_TRIPLETS]  # the prompt showed the real triplet as number 3
    columns = yes_no_cols(triplets=[shown])
    says = "<think>Evidence {} says the incidence is higher.</think><answer>no</answer>"
    assert score(evidence_use_reward, says.format(3), **columns) == 1.0
    assert score(evidence_use_reward, says.format(2), **columns) == 0.0


def test_evidence_use_on_options_cites_by_number_or_content():
    columns = cols(triplets=TRIPLETS) | {"question": ["A child has bowed legs. Which deficiency?"]}
    assert score(evidence_use_reward, "<think>Triplet #1, rickets, fits.</think><answer>B</answer>", **columns) == 1.0
    assert score(evidence_use_reward, "<think>Triplet #2, rickets, fits.</think><answer>B</answer>", **columns) == 0.0
    assert score(evidence_use_reward, "<think>A child with bowed legs.</think><answer>B</answer>", **columns) == 0.0


def test_evidence_references_are_read_in_linear_time():
    import time

    hostile = "<think>" + "evidence #[" * 40_000 + "</think><answer>no</answer>"
    started = time.perf_counter()
    assert score(evidence_use_reward, hostile, **yes_no_cols()) == 0.0
    assert time.perf_counter() - started < 2.0


# --- the default set, and TRL's calling convention -----------------------------------------------------


def respondent_funcs() -> list:
    """The respondent's reward functions, as `train_grpo` resolves them from an unset `rewards`."""
    return [reward.func for reward in resolve_rewards(None, RESPONDENT_REWARDS)]


def test_the_registry_resolves_named_weights():
    rewards = resolve_rewards(None, RESPONDENT_REWARDS)
    assert [r.func.__name__ for r in rewards] == [
        "well_formed_correctness_reward",
        "format_reward",
        "length_penalty",
        "evidence_use_reward",
    ]
    assert [r.name for r in rewards] == ["correctness", "format", "length", "evidence"]
    assert [r.weight for r in rewards] == [1.0, 0.5, 0.2, 0.2] == list(RESPONDENT_REWARDS.values())
    # given weights update the defaults: 0 drops a reward, a new name adds one
    rewards = resolve_rewards({"format": 0.0, "evidence": 1.0, "search_format": 0.1}, RESPONDENT_REWARDS)
    assert {r.name: r.weight for r in rewards} == {
        "correctness": 1.0,
        "length": 0.2,
        "evidence": 1.0,
        "search_format": 0.1,
    }
    # settings reach the rewards that have a field of that name, and no other
    length, correctness = [
        r.func
        for r in resolve_rewards(
            None, {"length": 1.0, "correctness": 1.0}, settings={"max_chars": 300, "max_think_chars": 5}
        )
    ]
    assert length(["x" * 300]) == [-1.0] and length.__name__ == "length_penalty"
    assert correctness is well_formed_correctness_reward
    with pytest.raises(ValueError, match=r"unknown reward\(s\) \['corectness'\]; known: \[.*'correctness'"):
        resolve_rewards({"corectness": 1.0}, RESPONDENT_REWARDS)
    with pytest.raises(ValueError, match="finite numbers"):
        resolve_rewards({"format": float("nan")}, RESPONDENT_REWARDS)
    with pytest.raises(ValueError, match="every reward weight is 0"):
        resolve_rewards({"correctness": 0}, {"correctness": 1.0})


def test_registry_rewards_are_picklable_and_keep_their_curve_names():
    assert REWARDS["correctness"] is well_formed_correctness_reward
    for func in REWARDS.values():
        assert pickle.loads(pickle.dumps(func)).__name__ == func.__name__


def test_rewards_score_what_the_model_wrote():
    """A rollout's `model_text` (the model's own tokens, without inserted documents) is what is scored; a
    completion without a search is its own text."""
    assert format_reward(["the transcript"], model_text=[GOOD]) == [1.0]
    assert correctness_reward([GOOD], model_text=[None], **cols()) == correctness_reward([GOOD], **cols()) == [1.0]


def test_called_exactly_as_grpo_trainer_calls_them():
    """`GRPOTrainer._calculate_rewards`: prompts=, completions= (message lists for a conversational
    dataset), completion_ids=, every other dataset column, trainer_state=, log_extra=, log_metric=."""
    from transformers import TrainerState

    prompt = [
        {"role": "system", "content": "You are a careful physician."},
        {"role": "user", "content": EXAMPLE[0]},
        {"role": "assistant", "content": EXAMPLE[1]},
        {"role": "user", "content": "Evidence: ...\nQuestion: ...\nOptions: ..."},
    ]
    texts = [GOOD, "<think>hmm</think>", "<think>scurvy</think><answer>A</answer> trailing", "x" * 2000]
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    n = len(texts)
    reward_kwargs = {
        "gold": ["B"] * n,
        "options": [OPTIONS] * n,
        "triplets": [TRIPLETS] * n,
        "question": ["A toddler with bowed legs ..."] * n,
        "run_id": ["r1"] * n,
        "trainer_state": TrainerState(),
        "log_extra": lambda *a, **k: None,
        "log_metric": lambda *a, **k: None,
    }
    funcs = respondent_funcs()
    table = {}
    for fn in funcs:
        assert "completions" in inspect.signature(fn).parameters
        out = fn(prompts=[prompt] * n, completions=completions, completion_ids=[[1, 2, 3]] * n, **reward_kwargs)
        assert len(out) == n and all(isinstance(v, float) and math.isfinite(v) for v in out)
        table[fn.__name__] = out
    assert table["well_formed_correctness_reward"] == [1.0, 0.0, 0.0, 0.0]
    assert table["format_reward"] == [1.0, 0.0, 0.0, 0.0]
    assert table["length_penalty"] == [0.0, 0.0, 0.0, -1.0]
    assert table["evidence_use_reward"] == [1.0, 0.0, 0.0, 0.0]


def test_trl_reward_calculation_code_path():
    """Run TRL's own `_calculate_rewards` (the installed version) on a bare trainer object."""
    from accelerate.state import PartialState
    from transformers import TrainerState
    from trl import GRPOTrainer

    funcs = respondent_funcs()
    trainer = object.__new__(GRPOTrainer)
    # A stand-in accelerator: a real Accelerator(cpu=True) would pin the process-wide accelerate state to
    # the CPU for every later test in the session.
    trainer.accelerator = SimpleNamespace(device="cpu", is_main_process=True)
    trainer.reward_funcs = funcs
    trainer.reward_processing_classes = [None] * len(funcs)
    trainer.reward_func_names = [f.__name__ for f in funcs]
    trainer.state = TrainerState()
    trainer.args = SimpleNamespace(report_to=[])
    trainer._log_completion_extra = lambda *a, **k: None
    trainer._log_metric = lambda *a, **k: None
    trainer.environments = None
    inputs = [{"prompt": [{"role": "user", "content": "Q"}], "gold": "B", "options": OPTIONS, "triplets": TRIPLETS}] * 2
    prompts = [x["prompt"] for x in inputs]
    completions = [[{"role": "assistant", "content": GOOD}], [{"role": "assistant", "content": "no idea"}]]
    fresh = not PartialState._shared_state
    try:
        rewards = trainer._calculate_rewards(inputs, prompts, completions, [[1], [2]])
    finally:
        if fresh:  # leave accelerate's process-wide state as it was found
            PartialState._reset_state()
    assert rewards.tolist() == [[1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]]


# --- extractor reward ----------------------------------------------------------------------------------

SNIPPET = (
    "Rickets in children is caused by vitamin D deficiency, which impairs bone mineralisation; sunlight "
    "exposure and dietary supplements prevent it. Severe cases present with bowed legs and delayed growth."
)
QUESTION = "Which vitamin deficiency causes rickets?"


def triplets_json(*rows: tuple[str, str, str]) -> str:
    return json.dumps([{"condition": c, "relation": r, "conclusion": z} for c, r, z in rows])


def test_faithful_triplet_beats_hallucinated_one():
    faithful = extractor_reward(
        triplets_json(("vitamin D deficiency in children", "causes", "rickets")), SNIPPET, question=QUESTION
    )
    invented = extractor_reward(
        triplets_json(("vitamin C deficiency in adults", "causes", "scurvy and anaemia")), SNIPPET, question=QUESTION
    )
    assert isinstance(faithful, ExtractorReward)
    assert faithful.structure == invented.structure == 1.0
    assert faithful.faithfulness == 1.0
    assert invented.faithfulness < 0.5
    assert faithful.total > invented.total
    assert faithful.usefulness is None
    assert faithful.total == pytest.approx((0.3 * 1 + 0.4 * 1 + 0.1 * 1) / 0.8)


def test_truncated_json_is_salvaged_at_half_structure_and_garbage_scores_zero():
    cut = '[{"condition": "vitamin D deficiency", "relation": "causes", "conclusion": "rickets"}, {"condition": "sun'
    salvaged = extractor_reward(cut, SNIPPET, question=QUESTION)
    assert salvaged.structure == 0.5 and salvaged.faithfulness == 1.0
    piped = extractor_reward("vitamin D deficiency | causes | rickets", SNIPPET, question=QUESTION)
    assert piped.structure == 0.5
    garbage = extractor_reward("I cannot help with that.", SNIPPET, question=QUESTION)
    assert (garbage.structure, garbage.faithfulness) == (0.0, 0.0)
    broken_items = extractor_reward('[{"condition": "rickets"}]', SNIPPET, question=QUESTION)
    assert broken_items.structure == 0.0  # a strict list, but no complete triplet and not a deliberate []


def test_empty_list_is_right_on_an_irrelevant_snippet_only():
    irrelevant = extractor_reward("[]", "Hand washing reduces hospital infections.", question=QUESTION)
    relevant = extractor_reward("[]", SNIPPET, question=QUESTION)
    assert irrelevant.structure == 1.0
    assert relevant.structure == 0.3
    assert irrelevant.faithfulness == relevant.faithfulness == 0.0
    # No claims, so faithfulness/conciseness do not count: a right `[]` scores like a faithful triplet.
    assert irrelevant.total == 1.0 and relevant.total == pytest.approx(0.3)
    faithful_but_off_topic = extractor_reward(
        triplets_json(("hand washing", "reduces", "hospital infections")),
        "Hand washing reduces hospital infections.",
        question=QUESTION,
    )
    assert irrelevant.total >= faithful_but_off_topic.total


def test_verbose_copy_of_the_snippet_is_less_concise():
    concise = extractor_reward(triplets_json(("vitamin D deficiency", "causes", "rickets")), SNIPPET)
    copy = extractor_reward(triplets_json((SNIPPET, "states", SNIPPET)), SNIPPET)
    assert concise.conciseness == 1.0
    assert copy.conciseness == 0.0
    assert copy.faithfulness == 1.0  # copying is faithful, just not concise
    assert concise.total > copy.total
    snippet = "s" * 1000
    assert extractor_reward(triplets_json(("x" * 398, "r", "z")), snippet).conciseness == 1.0  # 40%
    assert extractor_reward(triplets_json(("x" * 350, "", "z" * 350)), snippet).conciseness == pytest.approx(0.5)  # 70%
    assert extractor_reward(triplets_json(("x" * 400, "r", "z" * 399)), snippet).conciseness == pytest.approx(1 / 3)


def test_usefulness_none_renormalises_and_a_value_enters_the_total():
    completion = triplets_json(("vitamin D deficiency in children", "causes", "rickets"))
    without = extractor_reward(completion, SNIPPET, question=QUESTION)
    useful = extractor_reward(completion, SNIPPET, question=QUESTION, usefulness=1.0)
    useless = extractor_reward(completion, SNIPPET, question=QUESTION, usefulness=0.0)
    assert without.total == pytest.approx(1.0) and useful.total == pytest.approx(1.0)
    assert useless.total == pytest.approx(0.8) and useless.usefulness == 0.0
    assert extractor_reward(completion, SNIPPET, usefulness=float("nan")).usefulness is None
    assert extractor_reward(completion, SNIPPET, usefulness=3.0).usefulness == 1.0
    only_use = ExtractorRewardWeights(structure=0.0, faithfulness=0.0, conciseness=0.0, usefulness=1.0)
    assert extractor_reward(completion, SNIPPET, usefulness=0.25, weights=only_use).total == pytest.approx(0.25)
    assert extractor_reward(completion, SNIPPET, weights=only_use).total == 0.0  # nothing left to weigh
    assert set(useful.as_dict()) == {"structure", "faithfulness", "conciseness", "usefulness", "total"}


def test_weights_dataclass_has_help_and_rejects_bad_values():
    from dataclasses import fields

    assert all(f.metadata.get("help") for f in fields(ExtractorRewardWeights))
    assert ExtractorRewardWeights() == ExtractorRewardWeights(0.3, 0.4, 0.1, 0.2)
    with pytest.raises(ValueError):
        ExtractorRewardWeights(structure=-1.0)


def test_faithfulness_judge_overrides_token_overlap_and_falls_back_when_it_fails():
    completion = triplets_json(("vitamin D deficiency", "causes", "rickets"), ("sunlight", "prevents", "rickets"))
    seen = []

    def judge(snippet: str, claim: str) -> float:
        seen.append((snippet, claim))
        return 0.25

    judged = extractor_reward(completion, SNIPPET, faithfulness_judge=judge)
    assert judged.faithfulness == 0.25
    assert seen == [(SNIPPET, "vitamin D deficiency causes rickets"), (SNIPPET, "sunlight prevents rickets")]

    def broken(snippet: str, claim: str) -> float:
        raise RuntimeError("judge server down")

    assert extractor_reward(completion, SNIPPET, faithfulness_judge=broken).faithfulness == 1.0
    assert extractor_reward(completion, SNIPPET, faithfulness_judge=lambda s, c: float("nan")).faithfulness == 1.0
    assert extractor_reward(completion, SNIPPET, faithfulness_judge=lambda s, c: 7).faithfulness == 1.0  # clamped
    assert extractor_reward("[]", SNIPPET, faithfulness_judge=judge).faithfulness == 0.0  # no triplets, no call
    assert len(seen) == 2


def test_content_tokens_stem_and_drop_stop_words():
    assert content_tokens("The cause; it causes, it caused!") == ["caus", "caus", "caus"]
    assert content_tokens("Treated with treatments") == ["treat", "treat"]
    assert content_tokens(None) == []


# --- robustness: no reward raises on arbitrary model output --------------------------------------------

FRAGMENTS = [
    "<think>",
    "</think>",
    "<answer>",
    "</answer>",
    "<ANSWER>",
    "[",
    "]",
    "{",
    "}",
    '"condition": "',
    '"conclusion": "',
    '"relation": "',
    '", ',
    "|",
    "\n",
    "A",
    "B",
    "yes",
    "vitamin D",
    "Answer: ",
    "\\",
    '"',
    "(",
    ")",
    " ",
]
model_text = st.one_of(
    st.text(max_size=400),
    st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=12)), max_size=60).map("".join),
)
option_dicts = st.one_of(
    st.none(),
    st.just(OPTIONS),
    st.dictionaries(st.text(max_size=3), st.one_of(st.none(), st.text(max_size=20)), max_size=5),
)
triplet_lists = st.one_of(
    st.none(),
    st.just(TRIPLETS),
    st.lists(
        st.dictionaries(
            st.sampled_from(["condition", "relation", "conclusion", "snippet_id", "other"]),
            st.one_of(st.none(), st.text(max_size=30), st.integers()),
        ),
        max_size=3,
    ),
)


@settings(max_examples=300, deadline=None)
@given(
    text=model_text,
    gold=st.one_of(st.none(), st.text(max_size=20), st.sampled_from(["B", "yes"])),
    options=option_dicts,
    triplets=triplet_lists,
    snippet=st.text(max_size=300),
    question=st.text(max_size=80),
    usefulness=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),
    as_messages=st.booleans(),
)
def test_no_reward_raises_on_random_text(text, gold, options, triplets, snippet, question, usefulness, as_messages):
    completion = [{"role": "assistant", "content": text}] if as_messages else text
    columns = {"gold": [gold], "options": [options], "triplets": [triplets]}
    funcs = respondent_funcs()
    for fn in funcs:
        out = fn(prompts=["<answer>B</answer>"], completions=[completion], completion_ids=[[0]], **columns)
        assert len(out) == 1 and isinstance(out[0], float) and math.isfinite(out[0])
    reward = extractor_reward(text, snippet, question=question, usefulness=usefulness)
    for value in (reward.structure, reward.faithfulness, reward.conciseness, reward.total):
        assert 0.0 <= value <= 1.0
    assert reward.usefulness is None or 0.0 <= reward.usefulness <= 1.0


def test_the_reward_code_fingerprint_follows_the_code_and_not_its_docs():
    from ermedrag.training.rewards import code_sha256, reward_code_sha256

    rule = 'def reward(text):\n    """Pays a cited line."""\n    return 0.2 if "Evidence" in text else 0.0\n'
    documented = (
        '"""Rewards."""\n# why: the reasoning must cite\ndef reward(text):\n    """Pays a cited line,'
        ' restated."""\n\n    return 0.2 if "Evidence" in text else 0.0  # a bare label\n'
    )
    assert code_sha256([rule]) == code_sha256([documented])  # docstrings, comments and layout are not the rule
    for changed in (
        rule.replace("0.2", "0.3"),
        rule.replace('"Evidence"', '"evidence"'),
        rule.replace("text)", "text, question)"),
    ):
        assert code_sha256([changed]) != code_sha256([rule]), changed
    assert code_sha256([rule, rule]) != code_sha256([rule])  # every module counts
    assert reward_code_sha256() == reward_code_sha256() and len(reward_code_sha256()) == 64


def test_the_reward_code_includes_the_parsers_the_rewards_read_replies_with():
    from ermedrag.training.rewards import REWARD_MODULES, reward_modules

    modules = reward_modules()
    assert set(REWARD_MODULES) <= set(modules)
    # the parsers behind correctness, triplet structure, searches and triage are part of the rule
    assert {
        "ermedrag.agents.respondent",
        "ermedrag.agents.extractor",
        "ermedrag.agents.reasoner",
        "ermedrag.agents.triage",
    } <= set(modules)
    # the trainers, configs and package __init__ files (a version bump) are not
    assert not {"ermedrag", "ermedrag.agents", "ermedrag.training.trainers", "ermedrag.training.config"} & set(modules)
