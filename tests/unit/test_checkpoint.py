"""The RNG state every loop without the Trainer saves and restores (pipeline and mesh loops share
:func:`hftk.checkpoint.save_rng` / ``load_rng``): python, numpy, torch CPU (and CUDA when present)."""

from __future__ import annotations

import random

import numpy as np
import torch

from hftk.checkpoint import RNG_FILE, load_rng, save_rng


def _draws() -> tuple:
    cuda = torch.cuda.random.get_rng_state_all() if torch.cuda.is_available() else None
    if cuda is not None:
        torch.cuda.random.manual_seed_all(random.randrange(2**31))  # moves the CUDA generators too
    return (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist(),
            torch.nn.functional.dropout(torch.ones(16), 0.5).tolist(), cuda and [s.tolist() for s in cuda])


def test_load_rng_continues_every_generator_exactly(tmp_path):
    save_rng(tmp_path)
    assert torch.load(tmp_path / RNG_FILE.format(0), weights_only=True)  # loads without pickled objects
    first = _draws()
    assert _draws() != first
    assert load_rng(tmp_path)
    assert _draws() == first


def test_a_rank_without_a_saved_state_keeps_its_generators(tmp_path):
    before = torch.random.get_rng_state()
    assert not load_rng(tmp_path)
    assert torch.equal(torch.random.get_rng_state(), before)
