"""Per-rank telemetry of a training run: MFU, peak memory, communication share, rank imbalance.

:class:`RankMonitor` is plain (hftk's own loops call ``attach`` / ``step_begin`` / ``step_end``
/ ``collect``); :class:`RankMonitorCallback` drives it from the HF Trainer. The overhead stays
small: a timestamp per gradient hook, one ``all_gather`` of a few floats per *logging* step,
and one step every ``comm_timing_every`` steps whose collectives are timed for the communication share
(:mod:`hftk.telemetry.collectives`, not torch.profiler, whose stop could crash a rank).

Why imbalance is judged on *compute* time and not on step time: in synchronous data parallel
every rank waits for the slowest one at the gradient all-reduce (and at the Trainer's token
count all-reduce), so wall-clock step times come out equal on all ranks however unbalanced
the work is. What differs is each rank's compute time: from its forward start to its last
gradient, summed over the micro-batches of the step. The first step a process runs is left out of
it: its one-time work (allocator growth, lazy init, DDP's bucket rebuild) is uneven across balanced ranks.
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from hftk.comm.accounting import union_length
from hftk.telemetry.collectives import CollectiveTimer, measures_transfer
from hftk.telemetry.memory import model_state_bytes
from hftk.telemetry.metrics import append_jsonl

logger = logging.getLogger("hftk.telemetry.rank_monitor")
MB = 2**20

# Dense (no sparsity) peak TFLOPS per GPU from the vendors' datasheets, per compute dtype.
# Patterns match torch.cuda.get_device_name(), most specific first ("A10" must not catch "A100"/"A10G").
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    (r"H100.*PCIe", {"bf16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    (r"H[12]00.*NVL", {"bf16": 835.0, "tf32": 417.5, "fp32": 60.0}),  # H100 NVL and H200 NVL share these
    (r"H100|H200", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"L40S", {"bf16": 362.0, "tf32": 183.0, "fp32": 91.6}),
    (r"\bL4\b", {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"\bA10\b", {"bf16": 125.0, "tf32": 62.5, "fp32": 31.2}),
]


def compute_dtype(bf16: bool, fp16: bool) -> str:
    """Which peak column applies: half precision, TF32 matmuls, or plain fp32.

    Reads torch's new ``fp32_precision`` API, never the legacy ``allow_tf32`` flag: transformers
    (``--tf32``, ``--torch_compile`` in fp32) sets the new one, after which torch 2.13 raises on a
    legacy read ("mix of the legacy and new APIs"). The cuBLAS leaf resolves its parents
    (``torch.backends.fp32_precision``) and legacy writes alike.
    """
    if bf16 or fp16:
        return "bf16"
    return "tf32" if torch.backends.cuda.matmul.fp32_precision == "tf32" else "fp32"


def device_peak_flops(device: torch.device, dtype: str) -> float | None:
    """Peak FLOP/s of one device, or None on CPU and on GPUs missing from :data:`PEAK_TFLOPS`."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for pattern, peaks in PEAK_TFLOPS:
        if re.search(pattern, name):
            return peaks[dtype] * 1e12
    logger.warning("MFU not reported: no peak FLOP/s known for GPU '%s' (add it to hftk.telemetry.rank_monitor.PEAK_TFLOPS).", name)
    return None


def matmul_params(model: torch.nn.Module, active: dict[int, float] | None = None) -> tuple[float, float]:
    """(parameters used in matmuls, of which trainable): embedding lookups cost no FLOPs, a tied LM head does.
    ``active``: the share of each token that uses a parameter, by ``id`` (a mixture of experts' expert weights:
    top-k of E; :func:`hftk.models.moe.active_shares`), 1 for the others."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = getattr(head, "original_module", head)  # PEFT's trainable-tokens wrapper computes its .weight
    head_weight = getattr(head, "weight", None)
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding) and m.weight is not head_weight}
    # parameters() yields a tied weight once; ZeRO-3 leaves 0 elements locally, ds_numel is the full size
    share = active or {}
    sizes = [((getattr(p, "ds_numel", None) or p.numel()) * share.get(id(p), 1.0), p.requires_grad)
             for p in model.parameters() if id(p) not in lookups]
    return sum(size for size, _ in sizes), sum(size for size, trainable in sizes if trainable)


def flops_per_token(model: torch.nn.Module, seq_len: int, active: dict[int, float] | None = None) -> float:
    """Training FLOPs per token: 2N forward + 2N input gradients + 2N' weight gradients (N' trainable;
    6N for full fine-tuning), plus attention scores 12 * layers * hidden * seq_len (PaLM, appendix B); N counts
    the parameters a token uses (``active``: a mixture of experts' routed share, :func:`matmul_params`)."""
    total, trainable = matmul_params(model, active)
    return 4 * total + 2 * trainable + 12 * model.config.num_hidden_layers * model.config.hidden_size * seq_len


def reset_peak_memory(device: torch.device) -> bool:
    """Start a new peak-memory window; False when the OS refuses (the peak is then the lifetime peak)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def peak_memory_bytes(device: torch.device) -> int:
    """Peak since the last reset: allocated device memory on GPU, resident set (VmHWM) on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line: peak RSS cannot be read on this OS")


FIELDS = ("step_time_s", "compute_time_s", "cpu_time_s", "peak_mem_mb", "tensor_mb", "comm_share")


@dataclass
class Window:
    """Sums over the steps since the last collect."""

    steps: int = 0
    wall: float = 0.0
    cpu: float = 0.0
    segments: list[tuple[Any, Any]] = field(default_factory=list)  # (forward start, last gradient) marks
    computed_steps: int = 0
    comm_share: float = math.nan
    excluded_steps: int = 0  # the process's first step: its compute is one-time work, not the rank's pace


@dataclass
class RankMonitor:
    """One rank's timings and memory; ``collect`` gathers every rank's to rank 0.

    All ranks must call ``collect`` at the same points (it is one collective). ``comm_timing_every``
    > 0 times the collectives of step 3 (past warm-up) and then of every ``comm_timing_every``-th step, where
    the backend's futures time transfers (gloo; not NCCL's, which complete at enqueue).
    """

    device: torch.device
    imbalance_threshold: float = 0.2
    comm_timing_every: int = 0
    window: Window = field(default_factory=Window)
    _hooks: list[Any] = field(default_factory=list)
    _fwd_start: Any = None
    _last_grad: Any = None
    _step_computed: bool = False
    _last_end: tuple[float, float] | None = None
    _begin: tuple[float, float] = (0.0, 0.0)
    _timer: CollectiveTimer | None = None
    _timed: tuple[CollectiveTimer, float] | None = None  # the timed step's collectives and its wall time
    _peak_resettable: bool = True
    _windows_peak: int = 0  # the highest peak of the collected windows (collect resets the counter)
    _warned_unmeasured: bool = False
    _first_step_seen: bool = False
    _step_segments_from: int = 0  # where this step's segments start in the window

    def attach(self, model: torch.nn.Module) -> None:
        """Hooks timing each rank's compute: forward start, and every trainable parameter's gradient."""
        self._hooks.append(model.register_forward_pre_hook(self._on_forward))
        for param in model.parameters():
            if param.requires_grad:
                self._hooks.append(param.register_post_accumulate_grad_hook(self._on_grad))
        self._peak_resettable = reset_peak_memory(self.device)

    def detach(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _mark(self) -> Any:
        """A point in this rank's compute: a CUDA event on GPU (the CPU runs ahead of the GPU, and the
        gradient all-reduce waits on its own stream), a perf_counter reading on CPU."""
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _on_forward(self, module: torch.nn.Module, args: Any) -> None:
        if module.training:
            self._close_segment()
            self._fwd_start = self._mark()

    def _on_grad(self, param: torch.Tensor) -> None:
        self._last_grad = self._mark()

    def _close_segment(self) -> None:
        """One micro-batch's compute: its forward start to its last gradient."""
        if self._fwd_start is not None and self._last_grad is not None:
            self.window.segments.append((self._fwd_start, self._last_grad))
            self._step_computed = True
        self._fwd_start = self._last_grad = None

    def _compute_seconds(self) -> float:
        if self.device.type == "cuda":
            self._sync()
            return sum(start.elapsed_time(end) for start, end in self.window.segments) / 1e3
        return sum(end - start for start, end in self.window.segments)

    def step_begin(self, step: int) -> None:
        """``step``: 1-based number of the optimizer step about to run."""
        self._step_computed = False
        self._step_segments_from = len(self.window.segments)
        if self.comm_timing_every > 0 and measures_transfer(self.device) and (step == 3 or step % self.comm_timing_every == 0):
            self._timer = CollectiveTimer()
            self._timer.__enter__()
        self._begin = (time.perf_counter(), time.process_time())
        if self._last_end is None:
            self._last_end = self._begin

    def step_end(self) -> None:
        self._close_segment()
        now = (time.perf_counter(), time.process_time())
        w = self.window
        w.steps += 1
        w.wall += now[0] - self._last_end[0]  # end to end: data loading and waits count too
        w.cpu += now[1] - self._last_end[1]
        if not self._first_step_seen:
            # The first step this process runs (step 1, or the first after a resume) pays one-time work --
            # allocator growth, lazy init, DDP's bucket rebuild -- unevenly across ranks: no imbalance verdict.
            self._first_step_seen = True
            del w.segments[self._step_segments_from:]
            w.excluded_steps += 1
        else:
            w.computed_steps += int(self._step_computed)
        if self._timer is not None:
            self._timer.__exit__(None, None, None)
            self._timed = (self._timer, now[0] - self._begin[0])
            self._timer = None
        self._last_end = now

    def _read_timed_step(self) -> None:
        """Comm share of the timed step: the time some collective was in flight over the step's wall time."""
        if self._timed is not None:
            timer, wall = self._timed
            self.window.comm_share = union_length(timer.spans) / wall
            self._timed = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def local_stats(self, model: torch.nn.Module | None = None, optimizer: Any = None) -> list[float]:
        """This rank's window, in the order of :data:`FIELDS` (NaN where not measured)."""
        w = self.window
        steps = max(w.steps, 1)
        measured = w.steps - w.excluded_steps
        compute = self._compute_seconds() / measured if measured and w.computed_steps == measured else math.nan
        tensors = model_state_bytes(model, optimizer)["total"] / MB if model is not None else math.nan
        peak = peak_memory_bytes(self.device)
        self._windows_peak = max(self._windows_peak, peak)
        return [w.wall / steps, compute, w.cpu / steps, peak / MB, tensors, w.comm_share]

    def training_peak_bytes(self) -> int:
        """Peak memory since ``attach``, across the windows whose peaks ``collect`` reset."""
        return max(self._windows_peak, peak_memory_bytes(self.device))

    def collect(self, model: torch.nn.Module | None = None, optimizer: Any = None) -> RankSummary | None:
        """Gather every rank's window to rank 0 (one all_gather) and start a new window; returns the summary
        on rank 0, None on the other ranks."""
        self._read_timed_step()
        rows = gather_rows(self.local_stats(model, optimizer), self.device)
        measured_any = self.window.steps > self.window.excluded_steps
        self.window = Window()
        self._peak_resettable = reset_peak_memory(self.device)
        if dist.is_initialized() and dist.get_rank() != 0:
            return None
        summary = summarize(rows, self.imbalance_threshold, "gpu_allocated" if self.device.type == "cuda" else
                            ("rss_hwm" if self._peak_resettable else "rss_hwm_lifetime"))
        if summary.unmeasured and measured_any and self._hooks and not self._warned_unmeasured:
            self._warned_unmeasured = True  # hooks attached, yet no gradient reached them
            logger.warning("rank imbalance not measured: this strategy sets gradients without autograd "
                           "accumulating them, so the compute-timing hooks never fire; only wall-clock step "
                           "times are reported.")
        return summary


def gather_rows(local: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's row of floats, on every rank (NCCL needs the tensor on the GPU)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [local]
    on = device if "nccl" in str(dist.get_backend()) else torch.device("cpu")
    mine = torch.tensor(local, dtype=torch.float64, device=on)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return [row.tolist() for row in rows]


@dataclass
class RankSummary:
    """Rank 0's view of one logging window."""

    per_rank: dict[str, list[float | None]]
    scalars: dict[str, float]
    imbalance: float | None
    wait_share: float | None
    warning: str | None
    unmeasured: bool
    peak_mem_kind: str

    def record(self, step: int) -> dict[str, Any]:
        """The metrics.jsonl line: per-rank lists plus the imbalance verdict."""
        return {"step": step, "rank_stats": self.per_rank, "rank_imbalance": self.imbalance,
                "rank_wait_share": self.wait_share, "imbalance_warning": self.warning is not None,
                "peak_mem_kind": self.peak_mem_kind}

    def publish(self, step: int, metrics_path: Path) -> dict[str, float]:
        """Append the per-rank record to ``metrics_path``, warn if imbalanced; returns the tracker scalars."""
        append_jsonl(metrics_path, self.record(step))
        if self.warning:
            logger.warning("step %d: %s", step, self.warning)
        return self.scalars


def summarize(rows: list[list[float]], threshold: float, peak_mem_kind: str) -> RankSummary:
    """Per-rank lists, tracker scalars, and the imbalance verdict.

    ``rank_imbalance`` is slowest compute / fastest compute - 1; the warning is judged on
    ``rank_wait_share``, the slowest's compute minus the fastest's over the wall step: the share of
    every step the fastest rank idles, i.e. the throughput the imbalance costs. A ratio alone would
    cry wolf on small steps, where a few milliseconds of scheduling jitter are a large fraction.
    """
    cols = {name: [row[i] for row in rows] for i, name in enumerate(FIELDS)}
    per_rank = {name: [None if math.isnan(v) else v for v in values] for name, values in cols.items()}
    scalars = {"step_time_s_max": max(cols["step_time_s"]), "cpu_time_s_mean": sum(cols["cpu_time_s"]) / len(rows),
               "peak_mem_mb_max": max(cols["peak_mem_mb"])}
    if not any(math.isnan(v) for v in cols["tensor_mb"]):
        scalars["tensor_mb_max"] = max(cols["tensor_mb"])
    if shares := [v for v in cols["comm_share"] if not math.isnan(v)]:
        scalars["comm_share"] = sum(shares) / len(shares)
    compute = cols["compute_time_s"]
    unmeasured = any(math.isnan(v) for v in compute)
    imbalance, wait_share, warning = None, None, None
    if not unmeasured:
        slow, fast = max(range(len(rows)), key=compute.__getitem__), min(range(len(rows)), key=compute.__getitem__)
        gap, step = compute[slow] - compute[fast], max(cols["step_time_s"])
        imbalance = compute[slow] / compute[fast] - 1 if compute[fast] > 0 else math.inf
        wait_share = min(gap / step, 1.0) if step > 0 else 0.0
        scalars.update(compute_time_s_max=compute[slow], compute_time_s_min=compute[fast], rank_imbalance=imbalance,
                       rank_wait_share=wait_share)
        if wait_share > threshold:
            warning = (f"rank imbalance: rank {slow} computes {compute[slow]:.3f}s per step, rank {fast} "
                       f"{compute[fast]:.3f}s; the others wait for rank {slow}, {wait_share:.0%} of each "
                       f"{step:.3f}s step (> {threshold:.0%}).")
    return RankSummary(per_rank, scalars, imbalance, wait_share, warning, unmeasured, peak_mem_kind)


class RankMonitorCallback(TrainerCallback):
    """Drives a :class:`RankMonitor` from the Trainer; rank 0 adds its scalars to each training log
    (so tensorboard / wandb see them) and appends the per-rank record to ``metrics_path``."""

    def __init__(self, monitor: RankMonitor, metrics_path: Path) -> None:
        self.monitor = monitor
        self.metrics_path = metrics_path

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        """Hooks on the model when the loop hands one over. hftk's custom loop does not for the pipeline (a stage's
        micro-batches interleave with its waits, so forward-to-last-gradient is not its compute time):
        then the monitor reports wall/CPU time, memory and comm share, and no imbalance."""
        if model is not None:
            self.monitor.attach(model)
        else:
            reset_peak_memory(self.monitor.device)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.monitor.detach()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.monitor.step_begin(state.global_step + 1)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.monitor.step_end()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, model: Any = None,
               optimizer: Any = None, **kwargs: Any) -> None:
        if logs is None or "loss" not in logs or not self.monitor.window.steps:
            return
        summary = self.monitor.collect(model, optimizer)
        if summary is not None:
            logs.update(summary.publish(state.global_step, self.metrics_path))
