"Verifiers that cannot be gamed: a table of adversarial completions with the reward each must get."
from fractions import Fraction

import pytest

from gradient_garden.evals.verifiers import Problem, correctness, final_answer, well_formed

G18 = "Half of 36 is 36/2 = <<36/2=18>>18.\n#### 18"

def gsm(answer: str) -> Problem: return Problem("gsm8k", "gsm8k", "q", answer)

ADD = Problem("verifiable", "add", "What is 2 + 3?", "5")

# (problem, completion, stopped, expected reward, why)
TABLE = [
    (gsm(G18), "It is 17 or 18", True, 0.0, "a hedge without a final answer"),
    (gsm(G18), "#### 17\nCheck: 18", True, 0.0, "a second number after the final answer"),
    (gsm("#### 17"), "#### 17\nCheck: 18", True, 0.0, "the same hedge when 17 is right"),
    (gsm(G18), "#### 18 (per 2 weeks)", True, 1.0, "a remark in parentheses is not a second answer"),
    (gsm("#### 1500000"), "#### $1.5 million", True, 1.0, "currency and a scale word"),
    (gsm("#### -5"), "#### -$5", True, 1.0, "a sign before the currency"),
    (gsm("#### -5"), "#### $-5", True, 1.0, "a sign after the currency"),
    (gsm("#### 1000"), "#### 1,000", True, 1.0, "a thousands separator"),
    (gsm("#### 1,000"), "#### 1000", True, 1.0, "a thousands separator in the reference"),
    (gsm("#### 1.5"), "#### $1.5", True, 1.0, "a dollar amount"),
    (gsm("#### 0.75"), "#### 3/4", True, 1.0, "a fraction equals its decimal"),
    (gsm("#### 18"), "#### 36/2", True, 1.0, "an unreduced fraction"),
    (gsm("#### 0.33"), "#### 1/3", True, 0.0, "a fraction near, not equal to, the answer"),
    (gsm(G18), "#### 18.0", True, 1.0, "a trailing zero decimal"),
    (gsm(G18), "#### 18.", True, 1.0, "a final full stop"),
    (gsm(G18), "   ####    18   ", True, 1.0, "spaces around the answer"),
    (gsm(G18), "#### 18 apples", True, 1.0, "a unit word"),
    (gsm("#### 50"), "#### 50%", True, 1.0, "a percent sign"),
    (gsm("#### 2000"), "#### 2 thousand", True, 1.0, "a scale word"),
    (gsm(G18), "Step 1: 9 * 2 = 18\n#### 18", True, 1.0, "working before the final answer"),
    (gsm(G18), "#### 18\nI hope this helps!", True, 1.0, "words without a number after it"),
    (gsm(G18), "#### 18", False, 0.0, "cut off at the token budget"),
    (gsm(G18), "The answer is 18.", True, 0.0, "no final '####'"),
    (gsm(G18), "18", True, 0.0, "a bare number without the mark"),
    (gsm(G18), "#### 18\n#### 18", True, 0.0, "two final marks"),
    (gsm(G18), "#### 17\n#### 18", True, 0.0, "two final marks, two answers"),
    (gsm(G18), "#### #### 18", True, 0.0, "a doubled mark"),
    (gsm(G18), "#### 17 or 18", True, 0.0, "a hedge after the mark"),
    (gsm(G18), "#### 17-18", True, 0.0, "a range"),
    (gsm(G18), "#### 18 or 19", True, 0.0, "a hedge that starts right"),
    (gsm(G18), "#### 5 apples and 13 pears", True, 0.0, "two numbers on the answer line"),
    (gsm(G18), "#### 18\nThat is 18 in all.", True, 0.0, "a number repeated after the answer line"),
    (gsm(G18), "#### eighteen", True, 0.0, "a number in words"),
    (gsm(G18), "####", True, 0.0, "an empty answer"),
    (gsm(G18), "#### -18", True, 0.0, "the wrong sign"),
    (gsm("#### 10000"), "#### 1,0000", True, 0.0, "a malformed thousands separator"),
    (gsm("#### 18"), "#### 1,8", True, 0.0, "a comma that separates two numbers"),
    (gsm(G18), "", True, 0.0, "nothing"),
    (ADD, "5", True, 1.0, "exact match"),
    (ADD, " '5'.", True, 1.0, "quotes and a full stop do not count"),
    (ADD, "5", False, 0.0, "exact match cut off"),
    (ADD, "5 or 6", True, 0.0, "an exact-match hedge"),
    (ADD, "6\n5", True, 0.0, "a second line"),
    (ADD, "", True, 0.0, "nothing"),
]

@pytest.mark.parametrize("ex,completion,stopped,want,why", TABLE, ids=[r[4] for r in TABLE])
def test_adversarial_completions_get_their_reward(ex, completion, stopped, want, why):
    assert correctness(ex, completion, stopped) == want, why

def test_table_is_large_and_holds_the_known_exploits():
    done = {(c, p.answer) for p, c, *_ in TABLE}
    assert len(TABLE) >= 30
    for c in ("It is 17 or 18", "#### 17\nCheck: 18", "#### 18 (per 2 weeks)", "#### $1.5 million", "#### -$5"):
        assert any(c == d for d, _ in done), c

def test_final_answer_is_the_exact_value():
    "The extracted answer is exact (a Fraction's numerator/denominator), checked against Python's own arithmetic."
    for text, value in [("#### 1.5 million", Fraction(3, 2) * 10 ** 6), ("#### 0.125", Fraction(1, 8)),
                        ("#### -2.5 billion", Fraction(-5, 2) * 10 ** 9), ("#### 6/4", Fraction(3, 2)),
                        ("#### 1,234,567.5", Fraction(2469135, 2))]:
        assert Fraction(final_answer(text)) == value, text

def test_well_formed_follows_the_final_answer():
    g = gsm(G18)
    assert [well_formed(g, c, True) for c in ("#### 17", "#### 17 or 18", "17")] == [1.0, 0.0, 0.0]
    assert well_formed(g, "#### 18", False) == 0.0


# -- a format reward cannot outweigh correctness after the group's normalisation ---------------------------------

def _advantages(rewarder, group):
    "GRPO's z-scored advantages (the stage's own `group_advantages`) of one group's completions."
    import torch
    from gradient_garden.stages.grpo import group_advantages
    totals = rewarder.group_totals([rewarder(gsm(G18), c, s) for c, s in group])
    return group_advantages(torch.tensor(totals), len(group), "group")[0]

def test_format_reward_cannot_lift_a_group_of_wrong_answers():
    from gradient_garden.stages.rewards import Rewarder
    wrong = [("#### 0", True), ("I think 17", True), ("#### 17 or 18", True), ("#### 5", False)]
    assert _advantages(Rewarder(0.1), wrong).abs().max().item() == 0.0
    assert _advantages(Rewarder(0.0), wrong).abs().max().item() == 0.0

def test_right_answers_outrank_every_wrong_one_whatever_their_form():
    from gradient_garden.stages.rewards import Rewarder
    for w in (0.1, 0.5, 0.9):
        adv = _advantages(Rewarder(w), [("#### 18", True), ("#### 0", True), ("#### 3", True), ("so 18", True),
                                        ("#### 18 (per 2 weeks)", True), ("#### 18", False)])
        assert min(adv[0], adv[4]) > max(adv[1], adv[2], adv[3], adv[5]), (w, adv)

def test_format_weight_at_or_above_correctness_is_refused():
    from gradient_garden.config import ConfigError
    from gradient_garden.stages.rewards import Rewarder
    with pytest.raises(ConfigError, match="rl.format_reward: got 1.0; must be >= 0 and below the correctness weight"):
        Rewarder(1.0)
