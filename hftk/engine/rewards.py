"""The reward functions of a GRPO run (``--reward_funcs``): a function in a file (``FILE.py:NAME``), in a module
(``package.module:NAME``) or one TRL ships, by name. Before any process group: each loads, takes what TRL passes it
(``completions`` and the rest by keyword, hence ``**kwargs``) and finds every column it requires in the data. At each
step, on every rank: each function's output is checked (one number or None per completion, finite), and a bad one
(or one that raises) stops every rank at the same step with one line naming the function and the completion,
instead of TRL's traceback on one rank while the others wait in its gather."""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import sys
from pathlib import Path
from typing import Any, Callable

from hftk.core.errors import HftkError

FIELD = "training.reward_funcs"
# The reward functions TRL 1.16 ships (trl.rewards) that are reward functions themselves; its get_* factories need
# arguments first (a module path names them: ``trl.rewards:get_soft_overlong_punishment`` is refused by signature).
TRL_REWARDS = {"accuracy_reward": True, "reasoning_accuracy_reward": True, "think_format_reward": False}  # needs math_verify
# What TRL's GRPOTrainer passes every reward function besides the dataset's columns (_calculate_rewards).
TRL_KWARGS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments")
FIX = "return one float per completion (None for one it does not score)"


def load_reward_funcs(specs: list[str]) -> list[Callable[..., Any]]:
    """Every ``--reward_funcs`` entry as the callable it names, its signature checked; one line naming the entry
    when it cannot be loaded or cannot take what TRL passes."""
    if not specs:
        raise HftkError(FIELD, "--method grpo needs at least one reward function.",
                        "pass --reward_funcs FILE.py:NAME (a function of completions and **kwargs returning floats).")
    modules: dict[str, Any] = {}
    funcs = [_load(spec, modules) for spec in specs]
    names = [f.__name__ for f in funcs]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:  # TRL logs rewards/<name>/mean per function: two of one name would share a column
        raise HftkError(FIELD, f"two reward functions are named {twice}.", "rename one of them.")
    return funcs


def _load(spec: str, modules: dict[str, Any]) -> Callable[..., Any]:
    if ":" not in spec:
        return _trl_reward(spec)
    source, name = spec.rsplit(":", 1)
    module = modules.get(source) or _module(source, spec)
    modules[source] = module
    func = getattr(module, name, None)
    if func is None:
        defined = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        raise HftkError(FIELD, f"{spec}: {source} defines no {name}" + (f" (its functions: {', '.join(defined)})."
                                                                       if defined else "."),
                        "name a function the file or module defines.")
    if not callable(func):
        raise HftkError(FIELD, f"{spec}: {name} is not a function ({type(func).__name__}).",
                        "name a function of completions and **kwargs.")
    check_signature(func, spec)
    return func


def _trl_reward(name: str) -> Callable[..., Any]:
    if name not in TRL_REWARDS:
        raise HftkError(FIELD, f"'{name}' is neither FILE.py:NAME, package.module:NAME nor a reward function TRL "
                        f"ships ({', '.join(TRL_REWARDS)}).", "write it as rewards.py:my_reward.")
    if TRL_REWARDS[name] and importlib.util.find_spec("math_verify") is None:
        raise HftkError(FIELD, f"TRL's {name} needs the math_verify package, which is not installed.",
                        "pip install math-verify, or write your own reward function.")
    from trl import rewards

    return getattr(rewards, name)


def _module(source: str, spec: str) -> Any:
    """The module ``source`` names: a ``.py`` file (loaded under a name of its own, so two files of one name do
    not collide) or an importable module."""
    try:
        if not source.endswith(".py"):
            return importlib.import_module(source)
        path = Path(source).expanduser().resolve()
        if not path.is_file():
            raise HftkError(FIELD, f"{spec}: {source} is not a file.", "pass the path of your reward file.")
        name = f"hftk_rewards_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
        if name in sys.modules:
            return sys.modules[name]
        loader_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module  # pickling (dataloader workers, async loops) finds the functions by module
        loader_spec.loader.exec_module(module)
        return module
    except HftkError:
        raise
    except ModuleNotFoundError as exc:
        raise HftkError(FIELD, f"{spec}: cannot import {source} ({exc}).",
                        "install the package, or write FILE.py:NAME for a function in a file.") from None
    except Exception as exc:  # the user's module raised at import: its first line says what
        sys.modules.pop(locals().get("name", ""), None)
        raise HftkError(FIELD, f"{spec}: importing {source} raised {type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:200] if str(exc) else ''}", "fix the file.") from None


def check_signature(func: Callable[..., Any], spec: str) -> None:
    """TRL calls ``func(prompts=..., completions=..., completion_ids=..., trainer_state=..., <column>=..., ...)``:
    it must take ``completions`` and ``**kwargs`` (for what it does not name), and no positional-only argument."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return  # a builtin without a signature: called as TRL calls it
    positional_only = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_ONLY]
    if positional_only:
        raise HftkError(FIELD, f"{spec} takes {positional_only[0]} by position only; TRL passes everything by "
                        "keyword.", "drop the '/' from its signature.")
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        raise HftkError(FIELD, f"{spec} takes no **kwargs; TRL passes it completions=, prompts=, completion_ids=, "
                        "trainer_state= and every dataset column by keyword.",
                        f"define it as def {getattr(func, '__name__', 'reward')}(completions, **kwargs).")
    if not any(p.name == "completions" for p in params):
        raise HftkError(FIELD, f"{spec} does not take completions, the texts it scores.",
                        f"define it as def {getattr(func, '__name__', 'reward')}(completions, **kwargs).")


def required_columns(func: Callable[..., Any]) -> list[str]:
    """The arguments ``func`` requires that TRL fills from the dataset's columns."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is inspect.Parameter.empty and p.name not in TRL_KWARGS
            and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]


def check_columns(specs: list[str], funcs: list[Callable[..., Any]], columns: list[str], dataset: str) -> None:
    """Every argument a reward function requires is a column of the data (TRL passes each column by keyword)."""
    for spec, func in zip(specs, funcs):
        missing = [name for name in required_columns(func) if name not in columns]
        if missing:
            raise HftkError(FIELD, f"{spec} requires '{missing[0]}', which is not a column of {dataset} (its columns: "
                            f"{', '.join(sorted(columns))}).", f"add a '{missing[0]}' column to the data, or give "
                            f"the argument a default.")


class RewardProblems:
    """The first bad reward output this rank saw in a step, as (problem, fix): checked functions record it instead
    of raising inside TRL's reward computation, which every rank must finish (it ends in a gather)."""

    def __init__(self) -> None:
        self.first: tuple[str, str] | None = None

    def record(self, problem: str, fix: str) -> None:
        self.first = self.first or (problem, fix)

    def take(self) -> tuple[str, str] | None:
        problem, self.first = self.first, None
        return problem


def checked(func: Callable[..., Any], spec: str, problems: RewardProblems) -> Callable[..., Any]:
    """``func`` as TRL calls it, its output checked (:func:`output_problem`); a bad output or an exception is
    recorded in ``problems`` and the step's rewards from it read as unscored (None), so TRL's gather completes."""

    def judge(output: Any, kwargs: dict[str, Any]) -> Any:
        found = output_problem(output, kwargs["prompts"], kwargs["completions"])
        if found is None:
            return output
        problems.record(f"{spec} {found[0]}", found[1])
        return [None] * len(kwargs["completions"])

    def failed(exc: Exception, kwargs: dict[str, Any]) -> list[None]:
        message = str(exc).splitlines()[0][:200] if str(exc) else ""
        problems.record(f"{spec} raised {type(exc).__name__}: {message}.", "fix the function (it ran on the first "
                        "batch of completions; call it on them yourself to see the traceback).")
        return [None] * len(kwargs["completions"])

    if inspect.iscoroutinefunction(func):
        @functools.wraps(func)
        async def run_async(**kwargs: Any) -> Any:
            try:
                return judge(await func(**kwargs), kwargs)
            except Exception as exc:  # the user's code: reported as one line on every rank
                return failed(exc, kwargs)
        return run_async

    @functools.wraps(func)
    def run(**kwargs: Any) -> Any:
        try:
            return judge(func(**kwargs), kwargs)
        except Exception as exc:  # the user's code: reported as one line on every rank
            return failed(exc, kwargs)
    return run


def output_problem(output: Any, prompts: list[Any], completions: list[Any]) -> tuple[str, str] | None:
    """(problem, fix) of one reward function's output for these completions, or None when it is one real, finite
    number (or None: not scored, TRL's convention) per completion, in their order."""
    if isinstance(output, (str, bytes, dict)) or not hasattr(output, "__len__"):
        return f"returned a {type(output).__name__}, not a list of rewards.", f"{FIX}, as a list."
    if len(output) != len(completions):
        return f"returned {len(output)} rewards for {len(completions)} completions.", f"{FIX}, in their order."
    for index, value in enumerate(output):
        if value is None:
            continue
        if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a numpy or torch scalar
            value = value.item()
        where = f"completion {index} of the batch (prompt {_short(prompts[index])}, completion " \
                f"{_short(completions[index])})"
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return f"returned {value!r} ({type(value).__name__}) for {where}, not a number.", f"{FIX}."
        if not math.isfinite(float(value)):
            return (f"returned {float(value)} for {where}.",
                    "return a finite reward, or None for a completion it cannot score.")
    return None


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else " | ".join(
        str(m.get("content", m)) if isinstance(m, dict) else str(m) for m in value)
    return repr(text if len(text) <= 60 else text[:57] + "...")
