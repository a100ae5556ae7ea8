"""What validation hands to an engine: the config plus everything read while checking it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hftk.config.options import RunConfig


@dataclass
class PreparedRun:
    cfg: RunConfig
    model_config: Any  # transformers PretrainedConfig, read without weights
    raw: Any  # datasets.DatasetDict of the first dataset, normalised, not yet tokenised
    data_format: str  # "text", "prompt_completion", "messages", or several joined by "+"
    world_size: int  # what the launcher asked for
    sources: list[Any] = field(default_factory=list)  # hftk.data.dataset.Source: every dataset of the run
    tokenized: Any = None  # hftk.data.dataset.TokenizedData read from data.tokenized_path (then no sources)

    @property
    def has_eval(self) -> bool:
        if self.tokenized is not None:
            return self.tokenized.eval is not None
        splits = [s.cfg.eval_split for s in self.sources] or [self.cfg.data.eval_split]
        return any(splits) or self.cfg.data.eval_fraction > 0
