"""Datasets: load (Hub name, local file or folder, shipped corpus), tokenise, mask, pack, split.

Tokenisation goes through ``datasets.map`` so its results are cached by fingerprint and a
second run (or the second rank) reads them instead of recomputing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hftk import builtin
from hftk.config import DataConfig
from hftk.errors import HftkError

IGNORE_INDEX = -100
LOADERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


@dataclass
class TokenizedData:
    train: Any
    eval: Any | None
    data_format: str


def load_raw(cfg: DataConfig) -> Any:
    """A ``datasets.DatasetDict`` from wherever ``data.dataset`` points (quietly: this is validation)."""
    import datasets

    datasets.disable_progress_bars()
    try:
        return _load_raw(cfg)
    finally:
        datasets.enable_progress_bars()


def _load_raw(cfg: DataConfig) -> Any:
    import datasets

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
    except Exception as exc:  # datasets raises many types; the user needs the first line only
        raise HftkError("data.dataset", f"cannot load '{source}': {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
                        "check the path or Hub name (and data.dataset_config_name).") from None


def resolve_format(cfg: DataConfig, columns: list[str]) -> str:
    """Decide text vs prompt/completion and check the needed columns exist."""
    fmt = cfg.data_format
    if fmt == "auto":
        fmt = "prompt_completion" if {cfg.prompt_field, cfg.completion_field} <= set(columns) else "text"
    needed = [cfg.text_field] if fmt == "text" else [cfg.prompt_field, cfg.completion_field]
    names = {cfg.text_field: "data.text_field", cfg.prompt_field: "data.prompt_field",
             cfg.completion_field: "data.completion_field"}
    for column in needed:
        if column not in columns:
            raise HftkError(names[column], f"column '{column}' is not in the dataset (columns: {', '.join(columns)}).",
                            f"set {names[column]} to one of the columns.")
    return fmt


def check_raw(cfg: DataConfig, raw: Any) -> str:
    """Validation that needs the raw data: split, columns, emptiness. Returns the data format."""
    if cfg.train_split not in raw:
        raise HftkError("data.train_split", f"split '{cfg.train_split}' is not in the dataset ({', '.join(raw)}).",
                        "set data.train_split to an existing split.")
    if cfg.eval_split and cfg.eval_split not in raw:
        raise HftkError("data.eval_split", f"split '{cfg.eval_split}' is not in the dataset ({', '.join(raw)}).",
                        "set data.eval_split to an existing split or leave it unset.")
    train = raw[cfg.train_split]
    fmt = resolve_format(cfg, list(train.column_names))
    field = cfg.text_field if fmt == "text" else cfg.completion_field
    if len(train) == 0 or not any(str(v or "").strip() for v in train.select(range(min(len(train), 1000)))[field]):
        raise HftkError("data.dataset", f"the '{cfg.train_split}' split has no text in column '{field}'.",
                        "point data.dataset at a non-empty dataset.")
    return fmt


def tokenize_and_pack(cfg: DataConfig, raw: Any, tokenizer: Any, fmt: str, seed: int) -> TokenizedData:
    """Token ids + labels in fixed blocks of ``block_size``; prompts masked with -100.

    ``max_eval_samples`` caps the evaluation blocks, not raw rows (run_clm's convention): a block
    is what one evaluation forward costs, whatever the rows' lengths."""
    train = raw[cfg.train_split]
    if cfg.max_train_samples:
        train = train.select(range(min(cfg.max_train_samples, len(train))))
    evals = raw[cfg.eval_split] if cfg.eval_split else None
    if evals is None and cfg.eval_fraction > 0:
        split = train.train_test_split(test_size=cfg.eval_fraction, seed=seed, shuffle=True)
        train, evals = split["train"], split["test"]

    def encode(batch: dict[str, list]) -> dict[str, list]:
        return encode_batch(batch, tokenizer, cfg, fmt)

    def prepare(ds: Any) -> Any:
        ds = ds.map(encode, batched=True, remove_columns=ds.column_names, num_proc=cfg.preprocessing_num_workers,
                    desc="tokenize")
        block = pack_blocks if cfg.packing else pad_blocks
        return ds.map(lambda b: block(b, cfg.block_size, tokenizer.pad_token_id), batched=True,
                      remove_columns=ds.column_names, desc="pack" if cfg.packing else "pad")

    train_blocks = prepare(train)
    if len(train_blocks) == 0:
        raise HftkError("data.block_size", f"the training text is shorter than one block of {cfg.block_size} tokens.",
                        "lower data.block_size or add data.")
    eval_blocks = prepare(evals) if evals is not None else None
    if eval_blocks is not None and len(eval_blocks) == 0:
        eval_blocks = None
    if eval_blocks is not None and cfg.max_eval_samples:
        eval_blocks = eval_blocks.select(range(min(cfg.max_eval_samples, len(eval_blocks))))
    return TokenizedData(train=train_blocks.with_format("torch"),
                         eval=eval_blocks.with_format("torch") if eval_blocks is not None else None,
                         data_format=fmt)


def eval_line(cfg: DataConfig, blocks: int, batch_size: int, data_ranks: int) -> str:
    """What one evaluation costs, printed at start: blocks, and batches each rank runs through.

    Every engine spreads the blocks over its data-parallel ranks in batches of
    ``per_device_eval_batch_size`` (the Trainer's sharded loader, the pipeline's contiguous shards, the
    mesh loop's global batches), so ceil(blocks / (batch x ranks)) forwards per rank per evaluation.
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


def encode_batch(batch: dict[str, list], tokenizer: Any, cfg: DataConfig, fmt: str) -> dict[str, list]:
    """Token ids and labels per example; an eos closes every example."""
    eos = [tokenizer.eos_token_id]
    if fmt == "text":
        texts = [t for t in batch[cfg.text_field] if t and t.strip()]
        ids = [x + eos for x in tokenizer(texts, add_special_tokens=False)["input_ids"]]
        return {"input_ids": ids, "labels": [list(x) for x in ids]}
    prompts = tokenizer(batch[cfg.prompt_field], add_special_tokens=False)["input_ids"]
    completions = tokenizer(batch[cfg.completion_field], add_special_tokens=False)["input_ids"]
    input_ids, labels = [], []
    for p, c in zip(prompts, completions):
        input_ids.append(p + c + eos)
        labels.append([IGNORE_INDEX] * len(p) + c + eos)
    return {"input_ids": input_ids, "labels": labels}


def pack_blocks(batch: dict[str, list], block_size: int, pad_id: int) -> dict[str, list]:
    """Concatenate examples and cut full blocks; the remainder shorter than a block is dropped."""
    ids = [t for x in batch["input_ids"] for t in x]
    labels = [t for x in batch["labels"] for t in x]
    n = (len(ids) // block_size) * block_size
    return {
        "input_ids": [ids[i:i + block_size] for i in range(0, n, block_size)],
        "labels": [labels[i:i + block_size] for i in range(0, n, block_size)],
        "attention_mask": [[1] * block_size for _ in range(0, n, block_size)],
    }


def pad_blocks(batch: dict[str, list], block_size: int, pad_id: int) -> dict[str, list]:
    """One example per block: truncate or right-pad; padding is masked out of the loss."""
    out: dict[str, list] = {"input_ids": [], "labels": [], "attention_mask": []}
    for ids, labels in zip(batch["input_ids"], batch["labels"]):
        ids, labels = ids[:block_size], labels[:block_size]
        pad = block_size - len(ids)
        out["input_ids"].append(ids + [pad_id] * pad)
        out["labels"].append(labels + [IGNORE_INDEX] * pad)
        out["attention_mask"].append([1] * len(ids) + [0] * pad)
    return out
