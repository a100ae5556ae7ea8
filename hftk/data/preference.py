"""Preference rows for DPO: TRL's formats (standard strings, conversational message lists, implicit prompt)
checked row by row before any process group; tokenised by TRL's DPOTrainer's own code (also for ``hftk
preprocess``), then held to ``training.max_length`` as ``data.truncation`` says, with a summary line."""

from __future__ import annotations

from typing import Any

from hftk.core.errors import HftkError

PAIR_IDS = ("prompt_ids", "chosen_ids", "rejected_ids")  # the columns TRL 1.16's DPOTrainer tokenises a pair into
EXPECTED = "'prompt', 'chosen', 'rejected' (strings or message lists; 'prompt' may be left out: an implicit prompt)"


def preference_format(row: dict[str, Any]) -> str:
    """TRL's name for a preference row's format: conversational (message lists) or standard (strings)."""
    return "conversational" if isinstance(row.get("chosen"), list) else "standard"


def check_preference_rows(rows: Any, dataset: str, field: str = "data.dataset") -> str:
    """Refuse the first row that is not a preference pair, naming it and the expected fields; returns the
    format every row shares (a mix of strings and message lists is refused: TRL applies one per dataset)."""
    columns = set(rows.column_names)
    if not {"chosen", "rejected"} <= columns:
        raise HftkError(field, f"{dataset} row 0 has columns {sorted(columns)}, not a preference pair.",
                        f"--method dpo needs {EXPECTED}.")
    first = None
    for index, row in enumerate(rows):
        fmt = preference_format(row)
        first = first or fmt
        for name in ("prompt", "chosen", "rejected"):
            if name == "prompt" and "prompt" not in columns:
                continue
            value = row[name]
            shape = list if fmt == "conversational" else str
            if not isinstance(value, shape) or fmt != first:
                raise HftkError(field, f"{dataset} row {index}: '{name}' is {type(value).__name__}, not "
                                f"{'a message list' if first == 'conversational' else 'a string'} like row 0.",
                                f"--method dpo needs {EXPECTED}, one format per dataset.")
            if name != "prompt" and not value:
                raise HftkError(field, f"{dataset} row {index}: '{name}' is empty.",
                                "give every row a non-empty chosen and rejected completion, or drop the row.")
        if row["chosen"] == row["rejected"]:
            raise HftkError(field, f"{dataset} row {index}: 'chosen' equals 'rejected' (no preference to learn).",
                            "drop the row or fix its completions.")
    return first or "standard"


def load_preference_sources(cfg: Any) -> list[Any]:
    """Every dataset of the run through hftk's loader (``load_raw``), each split it reads checked as
    preference rows and cut to the pair's columns. Several datasets mix as for supervised fine-tuning
    (:func:`hftk.data.dataset.split_and_mix`) when they share one format and prompt layout: TRL reads one per dataset."""
    from hftk.data.dataset import Source, check_splits, load_raw, source_configs, with_default_weights

    sources = []
    for scfg, weight, field in source_configs(cfg):
        raw = load_raw(scfg)
        splits = check_splits(scfg, raw)
        formats = {check_preference_rows(raw[split], f"{scfg.dataset} ({split})", field) for split in splits}
        pair = [c for c in ("prompt", "chosen", "rejected") if c in raw[scfg.train_split].column_names]
        raw = raw.select_columns(pair)  # a dataset's other columns (ids, scores) would not concatenate
        fmt = "preference_" + "+".join(sorted(formats)) + ("" if "prompt" in pair else "_implicit_prompt")
        if sources and fmt != sources[0].fmt:
            raise HftkError(field, f"{scfg.dataset} holds {_described(fmt)} pairs, {sources[0].cfg.dataset} "
                            f"{_described(sources[0].fmt)} ones: TRL reads one format per dataset.",
                            "convert them to one format (message lists or strings; with or without 'prompt').")
        sources.append(Source(cfg=scfg, raw=raw, fmt=fmt, weight=weight, field=field))
    return with_default_weights(sources)


def _described(fmt: str) -> str:
    return fmt.removeprefix("preference_").replace("_implicit_prompt", " implicit-prompt").replace("+", " and ")


def tokenize_pairs(rows: Any, tokenizer: Any, args: Any, name: str) -> Any:
    """TRL's tokenisation of preference rows (``DPOTrainer._prepare_dataset``: prompt extracted, EOS added,
    the chat template applied, pairs whose prompt alone fills ``max_length`` dropped) where no trainer exists
    (``hftk preprocess``). TRL keeps it a trainer method that reads only the trainer's tokenizer, so it is
    called with a stand-in holding just that, rather than rewriting TRL's tokenisation here."""
    from types import SimpleNamespace

    from trl import DPOTrainer

    return DPOTrainer._prepare_dataset(SimpleNamespace(_tokenizer=tokenizer), rows, tokenizer, args, name)


def fit_pairs(pairs: Any, rows: int, max_length: int, truncation: str, name: str, announce: bool) -> Any:
    """Tokenised pairs held to ``max_length`` as ``data.truncation`` says: ``drop`` removes every pair whose
    prompt plus longer completion exceeds it; ``truncate`` leaves them to TRL's collator, which keeps the
    start (the completions lose their end, EOS included). ``rows``: the pairs before TRL's tokenisation, whose
    own drops (the prompt alone fills ``max_length``) are counted too. One summary line (``announce``: rank 0);
    a split left with no pair is an error naming the options."""
    longer = [i for i, (p, c, r) in enumerate(zip(*(pairs[column] for column in PAIR_IDS)))
              if len(p) + max(len(c), len(r)) > max_length]
    if truncation == "drop" and longer:
        cut = set(longer)
        pairs = pairs.select([i for i in range(len(pairs)) if i not in cut])
    dropped = rows - len(pairs)
    if (dropped or longer) and announce:
        done = (f"dropped {dropped}" if truncation == "drop" else
                f"truncated {len(longer)} (their completions cut short, without EOS), dropped {dropped} (the prompt "
                "fills max_length: no completion token left)")
        print(f"hftk: data: [{name}]: {done} of {rows} preference pairs longer than max_length {max_length} "
              f"(data.truncation={truncation})", flush=True)
    if not len(pairs):
        raise HftkError("training.max_length", f"every {name} preference pair is longer than max_length "
                        f"{max_length} (data.truncation={truncation}).",
                        "raise --max_length (or --block_size)" + (", or pass --truncation truncate." if
                                                                   truncation == "drop" else ": each prompt fills it."))
    return pairs
