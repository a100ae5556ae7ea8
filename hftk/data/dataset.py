"""Datasets: load (Hub name, local file or folder, shipped corpus; one or several), detect and
normalise the format (text, prompt/completion, chat messages, alpaca, sharegpt), check rows,
tokenise, mask, pack or pad, split, mix.

Tokenisation goes through ``datasets.map`` so its results are cached by fingerprint and a
second run (or the second rank) reads them instead of recomputing.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hftk.config.options import DATA_FORMATS, DEFAULT_DATASET, DataConfig, is_main_process
from hftk.core.errors import HftkError
from hftk.data import builtin, chat
from hftk.data.chat import IGNORE_INDEX

MESSAGES = "messages"  # the column every conversational format is normalised into
CONVERSATIONAL = ("messages", "sharegpt")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "tool": "tool"}
# The Alpaca prompt (Taori et al., 2023), used when no chat template is in use.
ALPACA_PROMPT = ("Below is an instruction that describes a task{with_input}. Write a response that appropriately "
                 "completes the request.\n\n### Instruction:\n{instruction}\n\n{input}### Response:\n")
# The column-name options of every format (DataConfig fields).
FIELD_OPTIONS = ("text_field", "prompt_field", "completion_field", "messages_field", "conversations_field",
                 "instruction_field", "input_field", "output_field")
# data.datasets entry keys -> DataConfig fields
ENTRY_KEYS = {"path": "dataset", "split": "train_split", "eval_split": "eval_split", "format": "data_format",
              "config_name": "dataset_config_name", "revision": "dataset_revision", **{f: f for f in FIELD_OPTIONS}}
LOADERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


@dataclass
class TokenizedData:
    train: Any
    eval: Any | None
    data_format: str


def load_raw(cfg: DataConfig) -> Any:
    """A ``datasets.DatasetDict`` from wherever ``data.dataset`` points (quietly: this is validation)."""
    import datasets

    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # a reader's failure is our one line, not its log
    source = cfg.dataset
    try:
        if builtin.is_builtin(source):
            key = source.removeprefix(builtin.PREFIX)
            if key not in builtin.BUILTIN_DATASETS:
                raise HftkError("data.dataset", f"unknown built-in dataset '{source}'.",
                                f"use one of: {', '.join(builtin.PREFIX + k for k in builtin.BUILTIN_DATASETS)}.")
            return datasets.load_dataset("text", data_files={"train": str(builtin.BUILTIN_DATASETS[key])})
        path = Path(source).expanduser()
        if path.is_file():
            loader = LOADERS.get(path.suffix.lower())
            if loader is None:
                raise HftkError("data.dataset", f"cannot read '{path.suffix}' files.",
                                f"use one of {', '.join(sorted(LOADERS))}, or a Hub dataset name.")
            return datasets.load_dataset(loader, data_files={"train": str(path)})
        if path.is_dir():
            return datasets.load_dataset(str(path))
        if source.startswith((".", "/", "~")):
            raise HftkError("data.dataset", f"'{source}' does not exist.", "pass an existing file or folder.")
        return datasets.load_dataset(source, cfg.dataset_config_name, revision=cfg.dataset_revision)
    except HftkError:
        raise
    except Exception as exc:  # datasets raises many types; the user needs the first line of the root cause
        raise HftkError("data.dataset", f"cannot load '{source}': {_root_cause(exc)}",
                        "check the path or Hub name (and data.dataset_config_name).") from None
    finally:
        datasets.logging.set_verbosity(verbosity)


def _root_cause(exc: BaseException) -> str:
    """First line of the innermost exception ("An error occurred while generating the dataset" says little)."""
    while exc.__cause__ is not None or (exc.__context__ is not None and not exc.__suppress_context__):
        exc = exc.__cause__ or exc.__context__
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


@dataclass
class Source:
    """One dataset of the run: its own view of the data options, its raw splits (normalised), its format."""

    cfg: DataConfig  # dataset, splits, format and field names of this dataset
    raw: Any  # datasets.DatasetDict; conversational formats normalised into a 'messages' column
    fmt: str  # text | prompt_completion | messages
    weight: float | None
    field: str  # how errors name it: data.dataset or data.datasets[i]


def source_configs(cfg: DataConfig) -> list[tuple[DataConfig, float | None, str]]:
    """Each dataset's options: ``data.datasets`` entries, or the comma-separated ``data.dataset``."""
    if not cfg.datasets:
        paths = [p.strip() for p in cfg.dataset.split(",") if p.strip()]
        if not paths:
            raise HftkError("data.dataset", "is empty.", "pass a dataset path or Hub name.")
        return [(dataclasses.replace(cfg, dataset=p, datasets=None), None, "data.dataset") for p in paths]
    if cfg.dataset != DEFAULT_DATASET:
        raise HftkError("data.datasets", "is set together with data.dataset.", "list every dataset in data.datasets.")
    out = []
    for i, entry in enumerate(cfg.datasets):
        field = f"data.datasets[{i}]"
        entry = {"path": entry} if isinstance(entry, str) else entry
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise HftkError(field, "needs a path.", "write '- path: data.jsonl' (or just the path).")
        unknown = sorted(set(entry) - set(ENTRY_KEYS) - {"weight"})
        if unknown:
            raise HftkError(f"{field}.{unknown[0]}", "is not a dataset option.",
                            f"use: {', '.join([*ENTRY_KEYS, 'weight'])}.")
        weight = entry.get("weight")
        if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight <= 0):
            raise HftkError(f"{field}.weight", f"must be a positive number, got {weight!r}.", "use e.g. 1 or 0.5.")
        fmt = entry.get("format", cfg.data_format)
        if fmt not in DATA_FORMATS:
            raise HftkError(f"{field}.format", f"'{fmt}' is not a data format.",
                            "use auto, text, prompt_completion, messages, alpaca or sharegpt.")
        values = {ENTRY_KEYS[k]: v for k, v in entry.items() if k in ENTRY_KEYS}
        out.append((dataclasses.replace(cfg, datasets=None, **values), None if weight is None else float(weight), field))
    return out


def describe(cfg: DataConfig) -> list[dict[str, Any]]:
    """Every dataset of the run as the run record and model card list it."""
    return [{"path": c.dataset, "split": c.train_split, "format": c.data_format, "weight": w}
            for c, w, _ in source_configs(cfg)]


def _trl_data() -> Any:
    import trl.data_utils

    return trl.data_utils


def resolve_format(cfg: DataConfig, columns: list[str], first_row: dict[str, Any] | None = None) -> str:
    """The declared format, or the one ``auto`` detects; checks the needed columns exist. TRL (and the wandb
    it imports, ~1.3 s) is loaded only when a conversation column is there to judge."""
    fmt = cfg.data_format
    row = first_row or {}
    if fmt == "auto":
        if cfg.messages_field in columns and _trl_data().is_conversational(
                {"messages": row.get(cfg.messages_field) or [{}]}):
            fmt = "messages"
        elif cfg.conversations_field in columns and _trl_data().is_conversational_from_value(
                {"conversations": row.get(cfg.conversations_field) or [{}]}):
            fmt = "sharegpt"
        elif {cfg.instruction_field, cfg.output_field} <= set(columns):
            fmt = "alpaca"
        elif {cfg.prompt_field, cfg.completion_field} <= set(columns):
            fmt = "prompt_completion"
        else:
            fmt = "text"
    needed = {"text": ["text_field"], "prompt_completion": ["prompt_field", "completion_field"],
              "messages": ["messages_field"], "sharegpt": ["conversations_field"],
              "alpaca": ["instruction_field", "output_field"]}[fmt]
    for option in needed:
        column = getattr(cfg, option)
        if column not in columns:
            raise HftkError(f"data.{option}", f"column '{column}' is not in the dataset (columns: {', '.join(columns)}).",
                            f"set data.{option} to one of the columns (or data.data_format to the right format).")
    return fmt


def check_splits(cfg: DataConfig, raw: Any) -> list[str]:
    """The splits the run reads (train, then eval if set), each checked to be in the dataset."""
    if cfg.train_split not in raw:
        raise HftkError("data.train_split", f"split '{cfg.train_split}' is not in {cfg.dataset} ({', '.join(raw)}).",
                        "set data.train_split to an existing split.")
    if cfg.eval_split and cfg.eval_split not in raw:
        raise HftkError("data.eval_split", f"split '{cfg.eval_split}' is not in {cfg.dataset} ({', '.join(raw)}).",
                        "set data.eval_split to an existing split or leave it unset.")
    return [s for s in (cfg.train_split, cfg.eval_split) if s]


def check_raw(cfg: DataConfig, raw: Any, field: str = "data.dataset") -> str:
    """Validation that needs the raw data: split, columns, emptiness. Returns the (declared) data format."""
    check_splits(cfg, raw)
    train = raw[cfg.train_split]
    if len(train) == 0:
        raise HftkError(field, f"the '{cfg.train_split}' split of {cfg.dataset} has no rows.",
                        "point it at a non-empty dataset.")
    _check_utf8(cfg, raw, field)
    fmt = resolve_format(cfg, list(train.column_names), train[0])
    if fmt in ("text", "prompt_completion"):
        _check_text_columns(cfg, train, [cfg.text_field] if fmt == "text" else [cfg.prompt_field, cfg.completion_field],
                            field)
        column = cfg.text_field if fmt == "text" else cfg.completion_field
        if not any(str(v or "").strip() for v in train.select(range(min(len(train), 1000)))[column]):
            raise HftkError(field, f"the '{cfg.train_split}' split of {cfg.dataset} has no text in column '{column}'.",
                            "point it at a non-empty dataset.")
    return fmt


def _check_utf8(cfg: DataConfig, raw: Any, field: str) -> None:
    """Arrow's JSON reader stores invalid UTF-8 unchecked; reading such a row later raises in the middle
    of tokenisation. A full validation of every split's table finds it now."""
    import pyarrow as pa

    for split, ds in raw.items():
        try:
            ds.data.table.validate(full=True)
        except pa.ArrowInvalid as exc:
            raise HftkError(field, f"split '{split}' of {cfg.dataset} is not valid UTF-8 text ({exc}).",
                            "re-encode the file as UTF-8.") from None


def _check_text_columns(cfg: DataConfig, train: Any, columns: list[str], field: str) -> None:
    """Text columns hold strings (nulls allowed): a column of numbers, or of mixed types (which datasets
    keeps as a Json column), would fail inside the tokenizer."""
    import datasets

    for column in columns:
        feature = train.features.get(column)
        if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string", "null")):
            kinds = sorted({type(v).__name__ for v in train.select(range(min(len(train), 1000)))[column]})
            raise HftkError(field, f"column '{column}' of {cfg.dataset} holds {'/'.join(kinds)} values, not text.",
                            f"make every value of column '{column}' a string.")


def load_sources(cfg: DataConfig, tokenizer_loader: Any) -> list[Source]:
    """Load, check and normalise every dataset (before any process group). ``tokenizer_loader()`` is called
    only when a format needs the chat template (conversations, alpaca)."""
    sources, tokenizer = [], None
    for scfg, weight, field in source_configs(cfg):
        raw = load_raw(scfg)
        fmt = check_raw(scfg, raw, field)
        template = None
        if fmt in (*CONVERSATIONAL, "alpaca"):
            tokenizer = tokenizer if tokenizer is not None else tokenizer_loader()
            template = (getattr(tokenizer, "chat_template", None) or None if fmt == "alpaca"
                        else chat.require_template(tokenizer, f"{scfg.dataset} holds conversations"))
        raw, fmt = normalise(scfg, raw, fmt, template, field)
        sources.append(Source(cfg=scfg, raw=raw, fmt=fmt, weight=weight, field=field))
    return with_default_weights(sources)


def with_default_weights(sources: list[Source]) -> list[Source]:
    """Where some datasets have a weight, the others weigh 1 (one weight alone mixes nothing)."""
    if any(s.weight is not None for s in sources) and len(sources) > 1:
        for s in sources:
            s.weight = 1.0 if s.weight is None else s.weight
    return sources


def normalise(cfg: DataConfig, raw: Any, fmt: str, template: Any, field: str) -> tuple[Any, str]:
    """Conversational formats -> a 'messages' column, alpaca -> messages (chat template in use) or a
    prompt/completion pair; rows that do not fit are refused or dropped (``data.on_bad_row``)."""
    import datasets

    if fmt in ("text", "prompt_completion"):
        return raw, fmt
    tools_ok = bool(template) and chat.supports_tools(template)
    out = {}
    for split in dict.fromkeys(s for s in (cfg.train_split, cfg.eval_split) if s):  # the splits this run reads
        ds = raw[split]
        ds = ds.map(_converter(cfg, fmt, template), batched=True, remove_columns=ds.column_names)
        out[split] = _check_rows(ds, cfg, field, split, tools_ok)
    new_fmt = "prompt_completion" if fmt == "alpaca" and not template else "messages"
    return datasets.DatasetDict(out), new_fmt


def _converter(cfg: DataConfig, fmt: str, template: Any) -> Any:
    """A batched map function from the dataset's own columns to the normalised ones."""
    from trl.data_utils import maybe_convert_to_chatml

    def keep(turns: Any) -> list[dict[str, Any]]:
        if not isinstance(turns, list):
            return turns
        return [{"role": t.get("role"), "content": t.get("content")} if isinstance(t, dict) else t for t in turns]

    def messages(batch: dict[str, list]) -> dict[str, list]:
        return {MESSAGES: [keep(t) for t in batch[cfg.messages_field]]}

    def sharegpt(batch: dict[str, list]) -> dict[str, list]:
        rows = []
        for turns in batch[cfg.conversations_field]:
            converted = keep(maybe_convert_to_chatml({"conversations": list(turns or [])})[MESSAGES])
            rows.append([{**t, "role": SHAREGPT_ROLES.get(t["role"], t["role"])} if isinstance(t, dict) else t
                         for t in converted])
        return {MESSAGES: rows}

    def alpaca(batch: dict[str, list]) -> dict[str, list]:
        inputs = batch.get(cfg.input_field) or [""] * len(batch[cfg.instruction_field])
        rows = list(zip(batch[cfg.instruction_field], inputs, batch[cfg.output_field]))
        if template:
            return {MESSAGES: [[{"role": "user", "content": f"{ins}\n\n{inp}" if inp else ins},
                                {"role": "assistant", "content": out}] for ins, inp, out in rows]}
        return {
            cfg.prompt_field: [ALPACA_PROMPT.format(instruction=ins, input=f"### Input:\n{inp}\n\n" if inp else "",
                                                    with_input=", paired with an input" if inp else "")
                               for ins, inp, _ in rows],
            cfg.completion_field: [out for _, _, out in rows],
        }

    return {"messages": messages, "sharegpt": sharegpt, "alpaca": alpaca}[fmt]


def row_problem(row: dict[str, Any], tools_ok: bool, prompt_field: str, completion_field: str) -> str | None:
    """Why a normalised row cannot be trained on, or None."""
    if MESSAGES not in row:
        return None if str(row.get(completion_field) or "").strip() else "the output is empty"
    turns = row[MESSAGES]
    if not isinstance(turns, list) or not turns:
        return "the conversation is not a non-empty list of turns"
    for i, turn in enumerate(turns):
        role = turn.get("role") if isinstance(turn, dict) else None
        if role not in chat.ROLES:
            return f"turn {i} has unknown role {role!r} (known: {', '.join(chat.ROLES)})"
        if role == "tool" and not tools_ok:
            return f"turn {i} is a tool turn and the chat template does not render tool turns"
        if not isinstance(turn.get("content"), str):
            return f"turn {i} has no text content"
        if role == "assistant" and not turn["content"].strip():
            return f"turn {i} is an empty assistant turn"
    first = next((t["role"] for t in turns if t["role"] != "system"), None)
    if first == "assistant":
        return "the conversation starts with an assistant turn (no prompt before it)"
    if turns[-1]["role"] != "assistant":
        return "the conversation does not end with an assistant turn"
    return None


def _check_rows(ds: Any, cfg: DataConfig, field: str, split: str, tools_ok: bool) -> Any:
    problems = [(i, p) for i, row in enumerate(ds)
                if (p := row_problem(row, tools_ok, cfg.prompt_field, cfg.completion_field))]
    if not problems:
        return ds
    i, problem = problems[0]
    if cfg.on_bad_row == "error":
        raise HftkError(field, f"row {i} of split '{split}' of {cfg.dataset}: {problem} "
                        f"({len(problems)} bad row(s) in all).",
                        "fix those rows, or pass --on_bad_row drop to skip them.")
    kinds = Counter(p.split(" ", 2)[-1] if p.startswith("turn ") else p for _, p in problems)
    if is_main_process():
        print(f"hftk: data: {cfg.dataset} [{split}]: dropped {len(problems)} of {len(ds)} rows ("
              + "; ".join(f"{n} x {k}" for k, n in kinds.most_common()) + ")", flush=True)
    bad = {i for i, _ in problems}
    kept = ds.select([i for i in range(len(ds)) if i not in bad])
    if len(kept) == 0:
        raise HftkError(field, f"every row of split '{split}' of {cfg.dataset} was dropped ({problem}).",
                        "fix the data or its format options.")
    return kept


def split_rows(cfg: DataConfig, raw: Any, seed: int) -> tuple[Any, Any | None]:
    """One dataset's training and held-out (or None) rows: the eval split if named, else ``eval_fraction`` of
    the (capped) training rows, held out with the run's seed."""
    train = raw[cfg.train_split]
    if cfg.max_train_samples:
        train = train.select(range(min(cfg.max_train_samples, len(train))))
    evals = raw[cfg.eval_split] if cfg.eval_split else None
    if evals is None and cfg.eval_fraction > 0:
        split = train.train_test_split(test_size=cfg.eval_fraction, seed=seed, shuffle=True)
        train, evals = split["train"], split["test"]
    return train, evals


def heldout_prompts(sources: list[Source], count: int, seed: int) -> list[str | list[dict[str, Any]]]:
    """The prompt part of the first ``count`` held-out rows, dataset after dataset: a pair's (or a preference
    pair's) prompt, an implicit-prompt preference pair's shared start, a conversation's turns before its last
    assistant turn (rendered later with the generation prompt)."""
    prompts: list[str | list[dict[str, Any]]] = []
    for source in sources:
        evals = split_rows(source.cfg, source.raw, seed)[1]
        for row in evals.select(range(min(count - len(prompts), len(evals)))) if evals is not None else []:
            if source.fmt == "messages":
                turns = row[MESSAGES]
                last = max(i for i, turn in enumerate(turns) if turn["role"] == "assistant")
                prompts.append([{"role": t["role"], "content": t["content"]} for t in turns[:last]])
            elif source.fmt.endswith("_implicit_prompt"):  # no prompt column: the start the pair shares, as TRL splits it
                from trl.data_utils import extract_prompt

                prompts.append(extract_prompt(dict(row))["prompt"])
            else:
                prompts.append(row[source.cfg.prompt_field])
    return prompts


def _blocks(cfg: DataConfig, raw: Any, tokenizer: Any, fmt: str, seed: int) -> tuple[Any, Any | None]:
    """One dataset's training and held-out (or None) blocks, unformatted."""
    train, evals = split_rows(cfg, raw, seed)
    template = chat.require_template(tokenizer, "the data holds conversations") if fmt == "messages" else None

    def encode(batch: dict[str, list]) -> dict[str, list]:
        return encode_batch(batch, tokenizer, cfg, fmt, template)

    def prepare(ds: Any, name: str) -> Any:
        n = len(ds)
        ds = ds.map(encode, batched=True, remove_columns=ds.column_names, num_proc=cfg.preprocessing_num_workers,
                    desc="tokenize")
        if fmt in TRUNCATED_UNITS:
            dropped, truncated = n - len(ds), sum(ds["truncated"]) if len(ds) else 0
            if (dropped or truncated) and is_main_process():
                print(f"hftk: data: {cfg.dataset} [{name}]: {truncation_summary(cfg.truncation, fmt, n, truncated, dropped)}"
                      f" longer than block_size {cfg.block_size} (data.truncation={cfg.truncation})", flush=True)
            if not len(ds):
                return ds  # every row dropped: a map with no output rows keeps no columns either
            ds = ds.remove_columns("truncated")
        return rows(ds, cfg.packing, cfg.block_size, fmt)

    train_blocks = prepare(train, cfg.train_split)
    if len(train_blocks) == 0:
        raise HftkError("data.block_size", f"the training text of {cfg.dataset} is shorter than one block of "
                        f"{cfg.block_size} tokens (or every conversation or prompt/completion pair is longer).",
                        "lower data.block_size, add data, or pass --truncation truncate.")
    eval_blocks = prepare(evals, "eval") if evals is not None else None
    return train_blocks, (eval_blocks if eval_blocks is not None and len(eval_blocks) else None)


TRUNCATED_UNITS = {"messages": "conversations", "prompt_completion": "prompt/completion pairs"}


def truncation_summary(mode: str, fmt: str, rows: int, truncated: int, dropped: int) -> str:
    """What ``data.truncation`` did to a split's rows longer than a block, for the summary line."""
    unit = TRUNCATED_UNITS[fmt]
    if mode == "drop":
        return f"dropped {dropped} of {rows} {unit}"
    if fmt == "messages":
        return f"truncated {truncated}, dropped {dropped} of {rows} {unit}"
    return (f"truncated {truncated} (their completions cut short, without EOS), dropped {dropped} (prompt fills the "
            f"block: no completion token left) of {rows} {unit}")


def check_holdouts(sources: list[Source]) -> None:
    """Every dataset that holds out ``eval_fraction`` of its rows keeps at least one to train on
    (``train_test_split`` holds out ceil(fraction x rows) rows)."""
    for s in sources:
        cfg, rows = s.cfg, len(s.raw[s.cfg.train_split])
        rows = min(rows, cfg.max_train_samples or rows)
        held = math.ceil(cfg.eval_fraction * rows)
        if not cfg.eval_split and cfg.eval_fraction > 0 and rows - held < 1:
            raise HftkError("data.eval_fraction", f"{cfg.dataset} has {rows} training row(s); holding out "
                            f"{cfg.eval_fraction} of them ({held}) leaves none to train on (at least {held + 1} "
                            "needed).", "add rows, pass --eval_fraction 0 (no evaluation), or name an --eval_split.")


def tokenize_and_pack(cfg: DataConfig, raw: Any, tokenizer: Any, fmt: str, seed: int) -> TokenizedData:
    """Token ids + labels in fixed blocks of ``block_size``; prompts masked with -100 (one dataset)."""
    return tokenized(cfg, *_blocks(cfg, raw, tokenizer, fmt, seed), fmt)


def tokenized(cfg: DataConfig, train: Any, eval_blocks: Any | None, data_format: str) -> TokenizedData:
    """The run's blocks as torch tensors, the evaluation capped by ``max_eval_samples``.

    The cap counts blocks, not raw rows (run_clm's convention): a block is what one evaluation
    forward costs, whatever the rows' lengths."""
    if eval_blocks is not None and cfg.max_eval_samples:
        eval_blocks = eval_blocks.select(range(min(cfg.max_eval_samples, len(eval_blocks))))
    return TokenizedData(train=train.with_format("torch"),
                         eval=eval_blocks.with_format("torch") if eval_blocks is not None else None,
                         data_format=data_format)


def tokenize_sources(sources: list[Source], tokenizer: Any, seed: int) -> TokenizedData:
    """Every dataset's blocks, mixed: interleaved by weight (seeded) when weights are given, else
    concatenated; held-out blocks concatenated."""
    import datasets

    if len(sources) == 1:
        s = sources[0]
        return tokenize_and_pack(s.cfg, s.raw, tokenizer, s.fmt, seed)
    train, eval_blocks = mix(sources, [_blocks(s.cfg, s.raw, tokenizer, s.fmt, seed) for s in sources], seed)
    return tokenized(sources[0].cfg, train, eval_blocks, combined_format(sources))


def split_and_mix(sources: list[Source], seed: int) -> tuple[Any, Any | None]:
    """(train, held-out) rows of a run whose trainer tokenises them (TRL's DPO pairs, GRPO's prompts): each dataset
    split as every dataset is (:func:`split_rows`, as the samples' held-out prompts are drawn), then mixed as
    supervised fine-tuning's blocks are (:func:`mix`)."""
    return mix(sources, [split_rows(s.cfg, s.raw, seed) for s in sources], seed)


def mix(sources: list[Source], parts: list[tuple[Any, Any | None]], seed: int) -> tuple[Any, Any | None]:
    """Each source's (train, held-out) ``parts`` as one: training rows interleaved by the sources' weights
    (seeded; datasets' ``interleave_datasets``) when weights are given, else concatenated; held-out rows
    concatenated (None when no source holds any)."""
    import datasets

    trains, evals = zip(*parts)
    if sources[0].weight is not None:
        total = sum(s.weight for s in sources)
        train = datasets.interleave_datasets(list(trains), probabilities=[s.weight / total for s in sources], seed=seed)
    else:
        train = datasets.concatenate_datasets(list(trains))
    held_out = [e for e in evals if e is not None]
    return train, datasets.concatenate_datasets(held_out) if held_out else None


def eval_line(cfg: DataConfig, blocks: int, batch_size: int, data_ranks: int) -> str:
    """What one evaluation costs, printed at start: blocks, and batches each rank runs through.

    Every engine spreads the blocks over its data-parallel ranks in batches of
    ``per_device_eval_batch_size`` (the Trainer's sharded loader, the custom loop's chunks of batch x
    replicas), so ceil(blocks / (batch x ranks)) forwards per rank per evaluation.
    """
    batches = -(-blocks // (batch_size * data_ranks))
    cap = (f"capped by data.max_eval_samples={cfg.max_eval_samples}" if cfg.max_eval_samples
           else "data.max_eval_samples caps it")
    return (f"hftk: evaluation: {blocks} blocks of {cfg.block_size} tokens, {batches} batches of {batch_size} per "
            f"rank over {data_ranks} data-parallel rank(s) per evaluation ({cap})")


def announce_eval(cfg: DataConfig, eval_blocks: Any | None, batch_size: int, data_ranks: int, main: bool) -> None:
    """Print :func:`eval_line` once (the main process), when the run evaluates at all."""
    if main and eval_blocks is not None:
        print(eval_line(cfg, len(eval_blocks), batch_size, data_ranks), flush=True)


def combined_format(sources: list[Source]) -> str:
    formats = sorted({s.fmt for s in sources})
    return formats[0] if len(formats) == 1 else "+".join(formats)


def encode_batch(batch: dict[str, list], tokenizer: Any, cfg: DataConfig, fmt: str,
                 template: str | None = None) -> dict[str, list]:
    """Token ids and labels per example; the tokenizer's BOS (if it adds one) opens it, an eos closes
    text and completions, a conversation ends as its template ends it."""
    bos = chat.bos_prefix(tokenizer)
    if fmt == "messages":
        return _encode_conversations(batch[MESSAGES], tokenizer, cfg, template or "")
    eos = [tokenizer.eos_token_id]
    if fmt == "text":
        texts = [t for t in batch[cfg.text_field] if t and t.strip()]
        ids = [bos + x + eos for x in tokenizer(texts, add_special_tokens=False)["input_ids"]]
        return {"input_ids": ids, "labels": [list(x) for x in ids]}
    prompts = tokenizer(batch[cfg.prompt_field], add_special_tokens=False)["input_ids"]
    completions = tokenizer(batch[cfg.completion_field], add_special_tokens=False)["input_ids"]
    out: dict[str, list] = {"input_ids": [], "labels": [], "truncated": []}
    for p, c in zip(prompts, completions):
        ids, labels = bos + p + c + eos, [IGNORE_INDEX] * (len(bos) + len(p)) + c + eos
        # concat packing splits a long pair across blocks; bfd and none would cut it at block_size
        long = cfg.packing != "concat" and len(ids) > cfg.block_size
        if long:
            if cfg.truncation == "drop" or len(bos) + len(p) >= cfg.block_size:
                continue  # dropped, or a prompt that fills the block: no completion token left to train on
            ids, labels = ids[:cfg.block_size], labels[:cfg.block_size]
        out["input_ids"].append(ids)
        out["labels"].append(labels)
        out["truncated"].append(long)
    return out


def _encode_conversations(conversations: list, tokenizer: Any, cfg: DataConfig, template: str) -> dict[str, list]:
    out: dict[str, list] = {"input_ids": [], "labels": [], "truncated": []}
    for messages in conversations:
        enc = chat.encode_conversation(tokenizer, messages, template)
        long = len(enc.input_ids) > cfg.block_size
        if long:
            if cfg.truncation == "drop" or (enc := chat.truncate(enc, cfg.block_size)) is None:
                continue
        out["input_ids"].append(enc.input_ids)
        out["labels"].append(chat.labels_for(enc, cfg.train_on_prompt))
        out["truncated"].append(long)
    return out


def rows(ds: Any, packing: str, block_size: int, fmt: str) -> Any:
    """Tokenised examples -> training rows for a resolved ``data.packing``: ``concat`` full blocks,
    ``bfd`` whole examples placed by TRL's best-fit decreasing (``seq_lengths`` per row: where each
    example starts; plain text longer than a block is split, anything else truncated), ``none`` one
    example per row cut to ``block_size`` (the collator pads each batch)."""
    _check_resolved(packing)
    if packing == "concat":
        return ds.map(lambda b: pack_blocks(b, block_size), batched=True, remove_columns=ds.column_names,
                      desc="pack")
    if packing == "bfd":
        from trl.data_utils import pack_dataset

        return pack_dataset(ds, block_size, strategy="bfd_split" if fmt == "text" else "bfd")
    return ds.map(lambda b: {k: [x[:block_size] for x in b[k]] for k in ("input_ids", "labels")}, batched=True,
                  desc="cut")


def _check_resolved(packing: str) -> None:
    if packing not in ("concat", "bfd", "none"):  # 'auto' depends on formats and strategy: validate resolves it
        raise ValueError(f"data.packing {packing!r} is not resolved (hftk.run.validate.resolve_packing)")


def collator(cfg: DataConfig, pad_id: int, fixed_length: int | None = None, attention: str | None = None) -> Any:
    """The batch builder of every engine: TRL's ``DataCollatorForLanguageModeling`` (its padding for
    ``concat`` / ``none``, see :func:`pad_rows`).

    ``bfd``: ``position_ids`` restarting at 0 per example, no attention mask, the label of every
    example's first token ignored (no token predicts the next example); transformers builds the
    block-diagonal mask from those position ids only when neither an attention mask nor a cache is in
    use, so the batch also says ``use_cache=False`` (a model in eval mode would otherwise open a cache
    and let examples attend to each other). The packed rows stay apart, padded to the batch's longest
    (sdpa / eager: each row's mask spans its own tokens, not the whole batch's); under flash attention
    they are flattened into one padding-free row, the only form its varlen path reads as packed.
    ``concat`` / ``none``: rows padded to the batch's longest, rounded up to ``pad_to_multiple_of`` --
    or to ``fixed_length`` for engines whose shapes are fixed (pipeline stages, tp / cp / sp)."""
    _check_resolved(cfg.packing)
    bfd = cfg.packing == "bfd"
    flat = bfd and (attention or "").startswith("flash_attention")
    multiple = fixed_length or (None if flat else cfg.pad_to_multiple_of)
    if not bfd:
        return lambda examples: pad_rows(examples, pad_id, multiple)
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    collate = DataCollatorForLanguageModeling(pad_token_id=pad_id, padding_free=flat, return_position_ids=True,
                                              pad_to_multiple_of=multiple)

    def build(examples: list[dict[str, Any]]) -> dict[str, Any]:
        plain = [{k: v.tolist() if hasattr(v, "tolist") else v for k, v in e.items()
                  if k in ("input_ids", "labels", "seq_lengths")} for e in examples]
        # TRL's varlen metadata (cu_seq_lens, seq_idx) and padding mask dropped: transformers derives the
        # boundaries from position_ids (padding restarts at 0: each pad token alone, its label ignored).
        batch = {k: v for k, v in collate(plain).items() if k in ("input_ids", "labels", "position_ids")}
        batch["labels"][batch["position_ids"] == 0] = IGNORE_INDEX
        batch["use_cache"] = False
        return batch

    return build


def pad_rows(examples: list[dict[str, Any]], pad_id: int, multiple: int | None) -> dict[str, Any]:
    """Rows padded on the right exactly as TRL's ``DataCollatorForLanguageModeling`` pads them without
    packing, with TRL's own ``pad``. That collator is not imported for them: its module loads TRL's trainer
    base, which imports wandb, a second of every rank's start-up that a run without wandb never uses."""
    import torch
    from trl.trainer.utils import pad

    ids = [torch.as_tensor(e["input_ids"]) for e in examples]
    labels = [torch.as_tensor(e["labels"]) for e in examples]
    return {"input_ids": pad(ids, padding_value=pad_id, padding_side="right", pad_to_multiple_of=multiple),
            "labels": pad(labels, padding_value=IGNORE_INDEX, padding_side="right", pad_to_multiple_of=multiple),
            "attention_mask": pad([torch.ones_like(x) for x in ids], padding_value=0, padding_side="right",
                                  pad_to_multiple_of=multiple)}


def pack_blocks(batch: dict[str, list], block_size: int) -> dict[str, list]:
    """Concatenate examples and cut full blocks; the remainder shorter than a block is dropped."""
    flat = {k: [t for x in batch[k] for t in x] for k in ("input_ids", "labels")}
    starts = range(0, len(flat["input_ids"]) // block_size * block_size, block_size)
    return {**{k: [v[i:i + block_size] for i in starts] for k, v in flat.items()},
            "attention_mask": [[1] * block_size for _ in starts]}
