"""The rank guard every multi-process test launches through (``tests.helpers.require_ranks``): a CPU host
runs any number of gloo ranks, a GPU host without a GPU per rank skips."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import require_ranks


def test_launches_skip_only_where_a_gpu_host_lacks_a_gpu_per_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    require_ranks(8)  # CPU-only host: gloo runs any number of ranks
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    require_ranks(1)
    with pytest.raises(pytest.skip.Exception, match="needs 2 GPUs .*this host has 1"):
        require_ranks(2)
