"""What validation hands to an engine: the config plus everything read while checking it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hftk.config import RunConfig


@dataclass
class PreparedRun:
    cfg: RunConfig
    model_config: Any  # transformers PretrainedConfig, read without weights
    raw: Any  # datasets.DatasetDict, not yet tokenised
    data_format: str  # "text" or "prompt_completion"
    world_size: int  # what the launcher asked for

    @property
    def has_eval(self) -> bool:
        return bool(self.cfg.data.eval_split) or self.cfg.data.eval_fraction > 0
