"""Per-rank telemetry, in one process: FLOPs per token, compute dtype, GPU peaks, imbalance verdicts,
the monitor's own numbers, and its option checks."""

from __future__ import annotations

import math

import pytest
import torch

from hftk.telemetry.rank_monitor import (FIELDS, RankMonitor, compute_dtype, device_peak_flops, flops_per_token,
                                         matmul_params, summarize)


@pytest.fixture(scope="module")
def tiny_model():
    from hftk.config.options import ModelConfig
    from hftk.models.loading import load_model

    return load_model(ModelConfig(model_name_or_path="builtin:gpt2-tiny", model_dropout=0.0))


def test_flops_per_token_counts_matmul_weights_and_attention(tiny_model):
    total, trainable = matmul_params(tiny_model)
    all_params = sum(p.numel() for p in tiny_model.parameters())  # tied wte/lm_head appear once
    wpe = tiny_model.transformer.wpe.weight.numel()
    assert total == trainable == all_params - wpe  # the position lookup costs nothing; the tied head does
    cfg = tiny_model.config
    assert flops_per_token(tiny_model, 64) == 6 * total + 12 * cfg.n_layer * cfg.n_embd * 64
    for p in tiny_model.transformer.h.parameters():  # frozen weights: no weight-gradient FLOPs
        p.requires_grad_(False)
    try:
        frozen = sum(p.numel() for p in tiny_model.transformer.h.parameters())
        assert flops_per_token(tiny_model, 64) == 6 * total - 2 * frozen + 12 * cfg.n_layer * cfg.n_embd * 64
    finally:
        for p in tiny_model.parameters():
            p.requires_grad_(True)


def test_compute_dtype_reads_tf32_as_transformers_sets_it():
    """transformers' ``--tf32`` / ``--torch_compile`` set torch's new fp32_precision API; a legacy
    ``allow_tf32`` read after that raises in torch 2.13 ("mix of the legacy and new APIs")."""
    from transformers.utils.import_utils import enable_tf32

    before = torch.backends.fp32_precision
    try:
        enable_tf32(True)
        assert compute_dtype(bf16=False, fp16=False) == "tf32"
        assert compute_dtype(bf16=True, fp16=False) == "bf16"
        enable_tf32(False)
        assert compute_dtype(bf16=False, fp16=False) == "fp32"
    finally:
        torch.backends.fp32_precision = before


@pytest.mark.parametrize("name,bf16", [("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0),
                                       ("NVIDIA H100 NVL", 835.0), ("NVIDIA H200", 989.4), ("NVIDIA H200 NVL", 835.0),
                                       ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A10", 125.0), ("NVIDIA L4", 121.0),
                                       ("NVIDIA L40S", 362.0), ("NVIDIA A10G", None)])
def test_gpu_peak_table_picks_the_variant_from_the_device_name(monkeypatch, name, bf16):
    """SXM vs PCIe vs NVL differ by up to 25 %; "A10" must not catch "A100" or "A10G" (unknown: no MFU)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    peak = device_peak_flops(torch.device("cuda", 0), "bf16")
    assert peak == (bf16 * 1e12 if bf16 else None)


def test_no_mfu_peak_on_cpu():
    assert device_peak_flops(torch.device("cpu"), "bf16") is None


def _rows(compute: list[float]) -> list[list[float]]:
    return [[1.0, c, 0.5, 800.0, 40.0, math.nan] for c in compute]


def test_imbalance_verdict():
    balanced = summarize(_rows([1.0, 1.1]), 0.2, "rss_hwm")
    assert balanced.imbalance == pytest.approx(0.1) and balanced.warning is None
    slow = summarize(_rows([1.0, 1.5, 1.05]), 0.2, "rss_hwm")
    assert slow.imbalance == pytest.approx(0.5) and slow.wait_share == pytest.approx(0.5 / 1.0)
    assert slow.warning and "rank 1" in slow.warning and "rank 0" in slow.warning
    assert slow.record(7)["imbalance_warning"] is True
    assert slow.scalars["rank_imbalance"] == pytest.approx(0.5) and "comm_share" not in slow.scalars
    # a large ratio of tiny compute times costs little of the step: no warning
    jitter = summarize(_rows([0.02, 0.03]), 0.2, "rss_hwm")
    assert jitter.imbalance == pytest.approx(0.5) and jitter.wait_share == pytest.approx(0.01) and jitter.warning is None
    unmeasured = summarize(_rows([1.0, math.nan]), 0.2, "rss_hwm")
    assert unmeasured.unmeasured and unmeasured.imbalance is None and "rank_imbalance" not in unmeasured.scalars
    assert unmeasured.per_rank["compute_time_s"] == [1.0, None]


def test_monitor_measures_compute_memory_and_timed_step(tiny_model):
    """One process: each number against what this test measures itself around the same steps; step 3's
    collectives are timed (none in one process) and the timer is gone once the step has ended."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    import resource
    import time

    monitor = RankMonitor(torch.device("cpu"), imbalance_threshold=0.2, comm_timing_every=100)
    monitor.attach(tiny_model)
    optimizer = torch.optim.AdamW(tiny_model.parameters(), lr=1e-4)
    ids = torch.randint(0, 2048, (2, 32))
    tiny_model.train()
    forward = backward = work_wall = work_cpu = 0.0
    start = (time.perf_counter(), time.process_time())
    for step in (1, 2, 3):
        monitor.step_begin(step)
        t0, c0 = time.perf_counter(), time.process_time()
        loss = tiny_model(input_ids=ids, labels=ids).loss
        if step == 1:
            time.sleep(0.3)  # one-time work inside step 1's compute: left out of the compute time
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        if step > 1:
            forward, backward = forward + t1 - t0, backward + t2 - t0
        work_wall, work_cpu = work_wall + time.perf_counter() - t0, work_cpu + time.process_time() - c0
        monitor.step_end()
    end = (time.perf_counter(), time.process_time())
    resident = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() / 2**20
    summary = monitor.collect(tiny_model, optimizer)
    monitor.detach()
    stats = {name: summary.per_rank[name][0] for name in FIELDS}
    # per step (steps 2 and 3: the first is one-time work): forward start to last gradient lies between the
    # forward and the whole backward
    assert forward / 2 <= stats["compute_time_s"] <= backward / 2, (forward, backward, stats)
    # per step, end to end: at least the model's work, at most the loop's span
    assert work_wall / 3 <= stats["step_time_s"] <= (end[0] - start[0]) / 3, (work_wall, stats)
    assert work_cpu / 3 <= stats["cpu_time_s"] <= (end[1] - start[1]) / 3, (work_cpu, stats)
    # the window's peak resident set: at least what is resident at its end (the kernel syncs its RSS counters
    # lazily: 1 MiB of slack), and not the process's earlier peaks (the window starts at attach): three tiny
    # steps add a few MiB of temporaries at most
    assert resident - 1 <= stats["peak_mem_mb"] <= resident + 64, (resident, stats)
    params_mb = sum(p.numel() for p in tiny_model.parameters()) * 4 / 2**20
    assert stats["tensor_mb"] == pytest.approx(3 * params_mb, rel=0.01)  # weights + Adam's two moments
    assert stats["comm_share"] == 0.0  # timed (NaN when not), and one process sends nothing
    assert _get_current_dispatch_mode() is None
    assert summary.scalars["compute_time_s_max"] == summary.scalars["compute_time_s_min"] == stats["compute_time_s"]
    assert monitor.window.steps == 0 and not monitor._hooks


@pytest.mark.parametrize("args,field", [(["--comm_profile_steps", "-1"], "tracking.comm_profile_steps"),
                                        (["--imbalance_warn_threshold", "0"], "tracking.imbalance_warn_threshold")])
def test_bad_monitor_options_are_one_clear_line(args, field, tmp_path, capsys):
    from hftk.run.prepare import main

    assert main(["--output_dir", str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0] and "Fix:" in err[0]


def test_a_window_of_only_the_first_step_gives_no_compute_verdict(tiny_model, caplog):
    """logging_steps=1: step 1's window has no measured step; no imbalance, and no 'not measured' warning."""
    monitor = RankMonitor(torch.device("cpu"))
    monitor.attach(tiny_model)
    ids = torch.randint(0, 2048, (2, 16))
    tiny_model.train()
    for step in (1, 2):
        monitor.step_begin(step)
        tiny_model(input_ids=ids, labels=ids).loss.backward()
        monitor.step_end()
        summary = monitor.collect()
        assert (summary.per_rank["compute_time_s"][0] is None) == (step == 1), (step, summary.per_rank)
    monitor.detach()
    assert "not measured" not in caplog.text
