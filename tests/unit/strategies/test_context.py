"""Context parallel (hftk/strategies/context.py) in one process: hftk's head-tail shards are the layout
torch's ring attention assumes, and a torch without the ring internals is refused by name."""

from __future__ import annotations

import pytest
import torch

LLAMA = ["--model_name_or_path", "builtin:llama-tiny"]


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_cp_shards_cover_each_sequence_once_in_the_layout_torch_ring_attention_assumes(cp):
    """hftk cuts sequences itself; torch's ring attention assumes its own head-tail balancer's layout."""
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    from hftk.strategies.context import head_tail_indices, shard_sequences

    seq = 8 * cp
    torch_order = _HeadTailLoadBalancer(seq, cp, "cpu")._generate_indices(restore=False).flatten()
    ours = torch.cat([head_tail_indices(seq, cp, rank) for rank in range(cp)])
    assert torch.equal(ours, torch_order)
    assert sorted(ours.tolist()) == list(range(seq))
    ids = torch.arange(2 * seq).view(2, seq)
    batch = {"input_ids": ids, "position_ids": ids % seq, "shift_labels": ids + 1,
             "attention_mask": torch.ones_like(ids)}
    local = shard_sequences(batch, cp, 1)
    assert set(local) == {"input_ids", "position_ids", "shift_labels"}  # the mask is dropped: attention is causal
    assert local["input_ids"].shape == (2, seq // cp)
    assert torch.equal(local["shift_labels"], local["input_ids"] + 1)  # labels travel with their tokens


def test_cp_on_a_torch_without_the_ring_internals_fails_by_name(monkeypatch, tmp_path):
    from hftk.config.options import load_config
    from hftk.core.errors import HftkError
    from hftk.data.builtin import builtin_model_config
    from hftk.strategies import context

    cfg = load_config([*LLAMA, "--strategy", "cp", "--cp_size", "2", "--output_dir", str(tmp_path / "x")])

    def older_torch():
        raise ImportError("No module named 'torch.distributed.tensor.experimental._context_parallel'")

    monkeypatch.setattr(context, "_ring_module", older_torch)
    with pytest.raises(HftkError, match="strategy.cp_size.*ring-attention internals"):
        context.validate(cfg, builtin_model_config("builtin:llama-tiny"), 2, "cuda")
