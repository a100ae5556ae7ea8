"""Flat-bucket all-reduce (hftk.comm.collectives) with a stand-in all-reduce: buckets filled up to the cap,
every sum written back."""

from __future__ import annotations

import torch


def test_flat_all_reduce_fills_buckets_up_to_the_cap_and_writes_every_sum_back(monkeypatch):
    """The pipeline's and sequence parallel's gradient reduction: a stand-in all-reduce doubles each flat
    bucket (the sum over two equal ranks) and records its size."""
    from hftk.comm import collectives

    sizes = []

    def all_reduce(flat, group=None):
        sizes.append(flat.numel() * flat.element_size())
        flat.mul_(2)

    monkeypatch.setattr(collectives.dist, "all_reduce", all_reduce)
    tensors = [torch.arange(n, dtype=torch.float32).reshape(-1, 1) + 1 for n in (3, 4, 10, 2, 2)]
    before = [t.clone() for t in tensors]
    collectives.all_reduce_flat(tensors, group=None, bucket_bytes=32)
    assert sizes == [28, 40, 16]  # 3+4 floats; 10 floats alone (over the cap); 2+2
    assert all(torch.equal(t, 2 * b) for t, b in zip(tensors, before))
