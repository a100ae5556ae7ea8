"""FSDP2 in one process (hftk.strategies.fsdp): a model that is not sharded is refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch


def test_verify_refuses_a_model_that_is_not_sharded():
    from hftk.core.errors import HftkError
    from hftk.strategies import fsdp

    plain = torch.nn.Linear(2, 2)
    with pytest.raises(HftkError, match="not an FSDP2 module"):
        fsdp.verify(SimpleNamespace(model=plain, model_wrapped=plain))
