"""GRPO's prompts: TRL's prompt formats (a ``prompt`` column of strings, or of message lists rendered with the run's
chat template) checked row by row before any process group; every other column is kept, since TRL hands each one
to the reward functions by keyword. Prompts longer than ``data.block_size`` tokens, rendered as TRL renders them at
every step, are dropped with a summary line (the plan and the context check count on that bound)."""

from __future__ import annotations

from typing import Any

from hftk.core.errors import HftkError

PROMPT = "prompt"
EXPECTED = "a 'prompt' column of strings or of message lists ([{role, content}, ...]); its other columns reach the " \
           "reward functions by keyword"


def prompt_format(value: Any) -> str:
    """TRL's name for a prompt's format: conversational (a message list) or standard (a string)."""
    return "conversational" if isinstance(value, list) else "standard"


def check_prompt_rows(rows: Any, dataset: str, field: str = "data.dataset") -> str:
    """Refuse the first row that is not a prompt, naming it and what is expected; returns the format every row
    shares (TRL renders a batch one way, so a mix of strings and message lists is refused)."""
    if PROMPT not in rows.column_names:
        raise HftkError(field, f"{dataset} has columns {sorted(rows.column_names)}, no 'prompt'.",
                        f"--method grpo needs {EXPECTED}.")
    first = None
    for index, value in enumerate(rows[PROMPT]):
        fmt = prompt_format(value)
        first = first or fmt
        problem = _prompt_problem(value) if fmt == first else \
            f"is {type(value).__name__}, not {'a message list' if first == 'conversational' else 'a string'} like row 0"
        if problem:
            raise HftkError(field, f"{dataset} row {index}: 'prompt' {problem}.",
                            f"--method grpo needs {EXPECTED}, one format per dataset.")
    return first or "standard"


def _prompt_problem(value: Any) -> str | None:
    if value is None:
        return "is missing (null)"
    if isinstance(value, str):
        return None if value.strip() else "is empty"
    if not isinstance(value, list):
        return f"is {type(value).__name__}"
    if not value:
        return "is an empty message list"
    for turn in value:
        if not (isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str)):
            return f"holds {turn!r}, not a {{role, content}} message"
    return None


def load_prompt_sources(cfg: Any) -> list[Any]:
    """Every dataset of the run through hftk's loader (``load_raw``), each split it reads checked as prompt rows.
    Several datasets mix as for supervised fine-tuning (:func:`hftk.data.dataset.split_and_mix`) when they share
    one format and the same columns (the reward functions read them)."""
    from hftk.data.dataset import Source, check_splits, load_raw, source_configs, with_default_weights

    sources = []
    for scfg, weight, field in source_configs(cfg):
        raw = load_raw(scfg)
        splits = check_splits(scfg, raw)
        formats = {check_prompt_rows(raw[split], f"{scfg.dataset} ({split})", field) for split in splits}
        if len(formats) > 1:
            raise HftkError(field, f"{scfg.dataset}'s splits hold prompts of two formats.",
                            "use strings or message lists in every split.")
        fmt = "prompt_" + formats.pop()
        columns = raw[scfg.train_split].column_names
        if sources and (fmt, columns) != (sources[0].fmt, (first := sources[0]).raw[first.cfg.train_split].column_names):
            raise HftkError(field, f"{scfg.dataset} holds {fmt.removeprefix('prompt_')} prompts with columns "
                            f"{sorted(columns)}, {first.cfg.dataset} {first.fmt.removeprefix('prompt_')} ones with "
                            f"{sorted(first.raw[first.cfg.train_split].column_names)}.",
                            "give every dataset one prompt format and the same columns (the reward functions read "
                            "them from each row).")
        sources.append(Source(cfg=scfg, raw=raw, fmt=fmt, weight=weight, field=field))
    return with_default_weights(sources)


def prompt_lengths(prompts: list[Any], tokenizer: Any) -> list[int]:
    """Each prompt's tokens as TRL's GRPOTrainer renders it (``_tokenize_prompts``): a string through the tokenizer,
    a message list through its chat template with the generation prompt."""
    if prompts and isinstance(prompts[0], list):
        return [len(ids) for ids in tokenizer.apply_chat_template(prompts, add_generation_prompt=True, tokenize=True,
                                                                  return_dict=True)["input_ids"]]
    return [len(ids) for ids in tokenizer(text=prompts)["input_ids"]]


def fit_prompts(sources: list[Any], tokenizer: Any, block_size: int, announce: bool) -> None:
    """Drop, in place, every prompt longer than ``block_size`` tokens from each dataset's splits, with one summary
    line per dataset that lost some (``announce``: rank 0); a training split left empty is an error naming the
    options. A template that cannot render a message-list prompt is one line too."""
    for source in sources:
        for split in list(source.raw):
            rows = source.raw[split]
            try:
                lengths = prompt_lengths(list(rows[PROMPT]), tokenizer)
            except Exception as exc:  # jinja2's errors, a template's raise_exception: the first line says which
                raise HftkError(source.field, f"{source.cfg.dataset} ({split}): the chat template cannot render its "
                                f"prompts ({str(exc).splitlines()[0][:200]}).",
                                "fix the prompts, or pass --chat_template for message lists.") from None
            keep = [i for i, n in enumerate(lengths) if n <= block_size]
            if len(keep) == len(rows):
                continue
            if announce:
                print(f"hftk: data: [{source.cfg.dataset} ({split})]: dropped {len(rows) - len(keep)} of {len(rows)} "
                      f"prompts longer than data.block_size {block_size} tokens (longest {max(lengths)})", flush=True)
            if not keep and split == source.cfg.train_split:
                raise HftkError("data.block_size", f"every prompt of {source.cfg.dataset} is longer than "
                                f"{block_size} tokens (the longest GRPO prompt).",
                                f"raise --block_size to at least {min(lengths)}.")
            source.raw[split] = rows.select(keep)
