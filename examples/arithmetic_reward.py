"""A verifiable reward for GRPO (`--reward_funcs examples/arithmetic_reward.py:arithmetic_reward`): the prompts of
examples/arithmetic.jsonl ask for a sum, their `answer` column holds it, and the reward checks the completion's
first number against it. TRL calls it with the completions and every column of the batch's rows by keyword."""

import re


def arithmetic_reward(completions, answer, **kwargs):
    """1.0 when the first number in a completion is the answer, 0.2 when it holds a number that is not (it answered
    in the right form), 0.0 when it holds none."""
    rewards = []
    for completion, expected in zip(completions, answer):
        text = completion if isinstance(completion, str) else completion[0]["content"]
        number = re.search(r"-?\d+", text)
        rewards.append(0.0 if number is None else 1.0 if int(number.group()) == int(expected) else 0.2)
    return rewards
