"""GRPO's reward functions: what loads (a file, a module, TRL's by name), every way one cannot be used refused in one
line before launch (missing file or function, not taking completions or **kwargs, a column the data lacks), and at a
step every bad output named with the function and the completion; the checked function hands TRL None rewards so
its gather completes on every rank."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from hftk.core.errors import HftkError
from hftk.engine.rewards import (RewardProblems, check_columns, checked, load_reward_funcs, output_problem,
                                 required_columns)


def _write(path, text):
    path.write_text(text)
    return path


@pytest.fixture
def rewards_file(tmp_path):
    return _write(tmp_path / "my_rewards.py", "import math\n"
                  "def length(completions, **kwargs):\n    return [float(len(c)) for c in completions]\n"
                  "def exact(completions, answer, hint=None, **kwargs):\n    return [float(c == a) for c, a in zip(completions, answer)]\n"
                  "async def later(completions, **kwargs):\n    return [1.0] * len(completions)\n"
                  "def no_kwargs(completions):\n    return []\n"
                  "def no_completions(prompts, **kwargs):\n    return []\n"
                  "def positional(completions, /, **kwargs):\n    return []\n"
                  "THRESHOLD = 3\n")


def test_functions_load_from_a_file_a_module_and_trls_names(rewards_file) -> None:
    length, exact, os_path = load_reward_funcs([f"{rewards_file}:length", f"{rewards_file}:exact",
                                                "tests.grpo_rollouts:e_share"])
    assert length(completions=["ab", "c"]) == [2.0, 1.0] and exact.__name__ == "exact"
    assert os_path(completions=["ee"]) == [1.0]
    from trl.rewards import think_format_reward

    assert load_reward_funcs(["think_format_reward"]) == [think_format_reward]
    assert load_reward_funcs([f"{rewards_file}:length"])[0] is length  # one module per file, loaded once


@pytest.mark.parametrize("spec, words", [
    ("{tmp}/missing.py:f", "missing.py is not a file"),
    ("{file}:nothing", "defines no nothing (its functions: exact, later, length, no_completions, no_kwargs, positional)"),
    ("{file}:THRESHOLD", "THRESHOLD is not a function (int)"),
    ("{file}:no_kwargs", "takes no **kwargs; TRL passes it completions=, prompts=, completion_ids="),
    ("{file}:no_completions", "does not take completions"),
    ("{file}:positional", "takes completions by position only"),
    ("no_such_module_xyz:f", "cannot import no_such_module_xyz"),
    ("trl.rewards:get_soft_overlong_punishment", "takes no **kwargs"),  # a factory, not a reward function
    ("my_reward", "'my_reward' is neither FILE.py:NAME, package.module:NAME nor a reward function TRL ships"),
])
def test_what_cannot_be_a_reward_function_is_one_line(rewards_file, tmp_path, spec, words) -> None:
    spec = spec.format(tmp=tmp_path, file=rewards_file)
    with pytest.raises(HftkError) as info:
        load_reward_funcs([spec])
    assert info.value.field == "training.reward_funcs" and words in info.value.one_line(), info.value.one_line()


def test_a_file_that_raises_at_import_and_two_functions_of_one_name(tmp_path, rewards_file) -> None:
    broken = _write(tmp_path / "broken.py", "raise RuntimeError('no GPU here')\n")
    with pytest.raises(HftkError, match="importing .*broken.py raised RuntimeError: no GPU here"):
        load_reward_funcs([f"{broken}:f"])
    other = _write(tmp_path / "other.py", "def length(completions, **kwargs):\n    return []\n")
    with pytest.raises(HftkError, match="two reward functions are named length"):
        load_reward_funcs([f"{rewards_file}:length", f"{other}:length"])
    with pytest.raises(HftkError, match="needs at least one reward function"):
        load_reward_funcs([])


def test_the_columns_a_function_requires_must_be_in_the_data(rewards_file) -> None:
    spec = f"{rewards_file}:exact"
    exact = load_reward_funcs([spec])[0]
    assert required_columns(exact) == ["answer"]  # hint has a default; completions and **kwargs are TRL's
    check_columns([spec], [exact], ["prompt", "answer"], "math.jsonl")
    with pytest.raises(HftkError) as info:
        check_columns([spec], [exact], ["prompt", "solution"], "math.jsonl")
    assert "requires 'answer', which is not a column of math.jsonl (its columns: prompt, solution)" in \
        info.value.problem


@pytest.mark.parametrize("output, words", [
    ([1.0], "returned 1 rewards for 2 completions."),
    ("good", "returned a str, not a list of rewards."),
    (0.5, "returned a float, not a list of rewards."),
    ([1.0, "high"], "returned 'high' (str) for completion 1 of the batch (prompt 'q2', completion 'a2'), not a number."),
    ([True, 1.0], "returned True (bool) for completion 0"),
    ([1.0, float("nan")], "returned nan for completion 1 of the batch (prompt 'q2', completion 'a2')."),
    ([float("inf"), 1.0], "returned inf for completion 0"),
])
def test_each_bad_output_names_the_completion(output, words) -> None:
    problem, fix = output_problem(output, ["q1", "q2"], ["a1", "a2"])
    assert words in problem, problem
    assert fix


def test_good_outputs_pass() -> None:
    import torch

    for output in ([1, 0.5], [None, 2.0], np.array([0.1, 0.2]), (np.float32(1.0), 0), torch.tensor([0.1, 0.2])):
        assert output_problem(output, ["q", "q"], ["a", "b"]) is None, output


def test_a_checked_function_records_the_first_problem_and_leaves_the_step_unscored() -> None:
    problems = RewardProblems()

    def nan_reward(completions, **kwargs):
        return [math.nan] * len(completions)

    def raising(completions, **kwargs):
        raise KeyError("answer")

    kwargs = {"prompts": [[{"role": "user", "content": "What is 2+2?"}]], "completions": ["4"]}
    assert checked(nan_reward, "r.py:nan_reward", problems)(**kwargs) == [None]
    assert checked(raising, "r.py:raising", problems)(**kwargs) == [None]
    problem, fix = problems.take()
    assert problem == "r.py:nan_reward returned nan for completion 0 of the batch (prompt 'What is 2+2?', completion '4')."
    assert problems.take() is None  # taken: the next step starts clean
    checked(raising, "r.py:raising", problems)(**kwargs)
    assert problems.take()[0] == "r.py:raising raised KeyError: 'answer'."


def test_an_async_function_stays_async_and_is_checked(rewards_file) -> None:
    import inspect

    later = load_reward_funcs([f"{rewards_file}:later"])[0]
    problems = RewardProblems()
    wrapped = checked(later, "later", problems)
    assert inspect.iscoroutinefunction(wrapped) and wrapped.__name__ == "later"  # TRL runs it on its event loop
    assert asyncio.run(wrapped(prompts=["q"], completions=["a"])) == [1.0] and problems.take() is None
