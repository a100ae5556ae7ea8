"""``hftk preprocess``: tokenise, template, mask and pack once into a ``save_to_disk`` folder that
training reads with ``--tokenized_path`` on every rank, with no tokenisation (``--method dpo``: TRL's
tokenised preference pairs, held to ``max_length``).

The folder carries a fingerprint of everything that shaped its blocks (tokenizer, chat template,
block size, formats, masking, truncation, datasets, split seed); a run whose config differs is
refused by the first differing name instead of training on blocks it did not ask for.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from hftk.checkpoint.hf_folder import write_atomically
from hftk.config.options import RunConfig
from hftk.core.errors import HftkError
from hftk.data.dataset import FIELD_OPTIONS, TokenizedData, describe, tokenized
from hftk.data.preference import PAIR_IDS

FINGERPRINT_FILE = "hftk_tokenized.json"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fingerprint(cfg: RunConfig, tokenizer: Any) -> dict[str, Any]:
    """What the blocks (or DPO's tokenised pairs) depend on; compared key by key when a run reads the folder."""
    d = cfg.data
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    common = {  # the template first: it decides which markers the tokenizer gained (data.add_chat_tokens)
        "chat_template": _digest(str(getattr(tokenizer, "chat_template", None) or "")),
        "tokenizer": _digest(vocab + json.dumps(tokenizer.special_tokens_map, sort_keys=True)),
        "method": cfg.preference.method, "truncation": d.truncation, "datasets": describe(d),
        "max_train_samples": d.max_train_samples, "eval_split": d.eval_split, "eval_fraction": d.eval_fraction,
        "seed": cfg.training.get("seed"),
    }
    if cfg.preference.method == "dpo":  # TRL tokenises whole pairs: no blocks, no packing, its own formats
        return {**common, "max_length": cfg.preference.max_length or d.block_size}
    return {**common, "block_size": d.block_size, "packing": d.packing, "train_on_prompt": d.train_on_prompt,
            "on_bad_row": d.on_bad_row, "fields": [getattr(d, f) for f in FIELD_OPTIONS]}


def _split_summary(ds: Any) -> dict[str, int]:
    """A split's size for the preprocess line and the folder's record: blocks (or pairs) and tokens."""
    if "input_ids" not in ds.column_names:  # DPO's tokenised pairs
        ids = [ds[c] for c in PAIR_IDS]
        return {"pairs": len(ds), "tokens": int(sum(len(x) for column in ids for x in column))}
    return {"blocks": len(ds), "tokens": int(sum(len(x) for x in ds["input_ids"])),
            "labelled_tokens": int(sum(sum(x != -100 for x in lab) for lab in ds["labels"]))}


def save(path: Path, data: TokenizedData, fp: dict[str, Any]) -> dict[str, Any]:
    """Write the blocks and the fingerprint (in a temporary sibling, renamed when complete)."""
    import datasets

    splits = {"train": data.train.with_format(None)}
    if data.eval is not None:
        splits["eval"] = data.eval.with_format(None)
    summary = {name: _split_summary(ds) for name, ds in splits.items()}

    def write(tmp: Path) -> None:
        datasets.DatasetDict(splits).save_to_disk(str(tmp))
        (tmp / FINGERPRINT_FILE).write_text(json.dumps({"fingerprint": fp, "data_format": data.data_format,
                                                        "summary": summary}, indent=1, sort_keys=True))

    write_atomically(path, write)
    return summary


def load(cfg: RunConfig, tokenizer: Any) -> TokenizedData:
    """The blocks of ``data.tokenized_path``, refused when made with another config."""
    import datasets

    path = Path(cfg.data.tokenized_path)
    meta_file = path / FINGERPRINT_FILE
    if not meta_file.is_file():
        raise HftkError("data.tokenized_path", f"'{path}' is not a folder written by hftk preprocess.",
                        "run `hftk preprocess --config run.yaml --tokenized_path DIR` first.")
    meta = json.loads(meta_file.read_text())
    from hftk.run.validate import resolve_packing

    if cfg.preference.method != "dpo":
        resolve_packing(cfg, meta["data_format"])  # 'auto' as it resolved when the folder was made
    want = fingerprint(cfg, tokenizer)
    for key, value in want.items():
        made = meta["fingerprint"].get(key, "sft" if key == "method" else None)  # older folders: SFT's, unnamed
        if made != value:
            raise HftkError("data.tokenized_path", f"'{path}' was made with another {key} ({made!r}, this run: "
                            f"{value!r}).", "run hftk preprocess again with this run's config, or train with the "
                            "config it was made with.")
    ds = datasets.load_from_disk(str(path))
    held_out = ds["eval"] if "eval" in ds else None
    if cfg.preference.method == "dpo":  # TRL's tokenised pairs, as its DPOTrainer reads them
        return TokenizedData(train=ds["train"], eval=held_out, data_format=meta["data_format"])
    return tokenized(cfg.data, ds["train"], held_out, meta["data_format"])
