"""The custom loop's rules (hftk/engine/loop.py) in one process: its loader splits each global batch
over data-parallel replicas, and its stop rule drops a non-finite update and agrees on a signal."""

from __future__ import annotations

import pytest
import torch

LLAMA = ["--model_name_or_path", "builtin:llama-tiny"]


def test_data_parallel_ranks_split_each_global_batch_without_repeats():
    """The loop's loader (accelerate's seedable sampler sharded over data-parallel replicas, as the Trainer's):
    within one optimizer step the replicas read disjoint samples; an epoch reads every sample, the last short
    batch filled from the start (``even_batches``), and the next epoch is reshuffled."""
    from types import SimpleNamespace

    from transformers import TrainingArguments

    from hftk.engine.loop import _set_epoch, _train_loader

    args = TrainingArguments("unused", per_device_train_batch_size=3, use_cpu=True, report_to=[])
    loaders = [_train_loader(args, list(range(50)), SimpleNamespace(dp_size=2, dp_rank=r), lambda rows: rows)
               for r in range(2)]

    def epoch(e: int) -> list[list[list[int]]]:
        for loader in loaders:
            _set_epoch(loader, e)
        return [list(loader) for loader in loaders]

    first = epoch(0)
    assert len(first[0]) == len(first[1]) == 9
    for a, b in zip(*first):
        assert not set(a) & set(b)  # one step's samples: no repeats across replicas
    seen = [i for batches in first for batch in batches for i in batch]
    assert set(seen) == set(range(50)) and len(seen) == 54  # 4 samples repeated to fill the last batches
    assert epoch(1) != first


@pytest.fixture()
def one_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_nonfinite_gradient_drops_the_update_and_a_signal_is_agreed(one_rank_group):
    """The loop's stop rules on a tp step: a NaN gradient drops the update for every rank (gradients
    cleared, so the optimizer leaves the weights alone) and a signal seen here stops the run."""
    import math
    import signal
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from hftk.config.options import load_config
    from hftk.data.builtin import materialize_model
    from hftk.engine.loop import _guard
    from hftk.engine.resilience import EXIT_PREEMPTED, PreemptionSignal
    from hftk.strategies import tensor

    cfg = load_config([*LLAMA, "--strategy", "tp", "--nan_policy", "skip"])
    model = AutoModelForCausalLM.from_pretrained(materialize_model("builtin:llama-tiny"))
    step = tensor.build_step(model, cfg, SimpleNamespace(bf16=False))
    optimizer = torch.optim.AdamW(step.param_groups(0.0), lr=1e-3)
    ids = torch.randint(0, 2048, (2, 16))
    with torch.no_grad():
        step.module.model.norm.weight[0] = float("nan")
    before = {n: p.detach().clone() for n, p in step.params}
    assert not math.isfinite(step.forward_backward([{"input_ids": ids, "labels": ids}]))
    preemption = PreemptionSignal()
    preemption.received = signal.SIGTERM
    run = SimpleNamespace(step=step, signal=preemption, prepared=SimpleNamespace(cfg=cfg), exit_code=None,
                          stop_reason="")
    assert _guard(run) and run.exit_code == EXIT_PREEMPTED and "SIGTERM" in run.stop_reason
    optimizer.step()
    assert all(torch.allclose(before[n], p, equal_nan=True) for n, p in step.params)
    assert not optimizer.state  # no parameter had a gradient: nothing was updated
