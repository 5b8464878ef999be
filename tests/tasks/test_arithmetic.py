import random

import pytest

from ais_lightning.tasks import get_task


def test_reward_exact_values():
    task = get_task("arithmetic")
    prompts = ["12+34="] * 7
    completions = ["46", " 46 \njunk", "46\n", "45", "046x", "", "4 6"]
    assert task.reward(prompts, completions, answer=[46] * 7) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_reward_without_fields_reevaluates_the_prompt():
    task = get_task("arithmetic", operators="+-*")
    # hand-computed with precedence: 2+3*4 = 14, 10-25 = -15
    assert task.reward(["2+3*4=", "10-25=", "2+3*4="], ["14", "-15", "20"]) == [1.0, 1.0, 0.0]


def test_samples_have_requested_shape():
    task = get_task("arithmetic", digits=3, operators="-", allow_negative=False)
    rng = random.Random(0)
    for _ in range(200):
        s = task.sample(rng)
        a, b = s.prompt[:-1].split("-")
        assert len(a) == 3 and len(b) == 3 and s.prompt.endswith("=")
        assert int(a) - int(b) == s.fields["answer"] == int(s.solution) >= 0


def test_min_digits_and_operators_are_drawn():
    task = get_task("arithmetic", digits=2, min_digits=1, operators="+*", num_operands=3)
    rng = random.Random(0)
    samples = [task.sample(rng) for _ in range(300)]
    ops = {ch for s in samples for ch in s.prompt if ch in "+-*"}
    lengths = {len(x) for s in samples for x in s.prompt[:-1].replace("*", "+").split("+")}
    assert ops == {"+", "*"} and lengths == {1, 2}
    assert all(task.reward([s.prompt], [s.solution]) == [1.0] for s in samples)


@pytest.mark.parametrize(
    "kwargs", [{"digits": 0}, {"operators": "/"}, {"operators": ""}, {"min_digits": 3}, {"num_operands": 1}]
)
def test_bad_options(kwargs):
    with pytest.raises(ValueError):
        get_task("arithmetic", **kwargs)
