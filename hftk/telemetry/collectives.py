"""Time in collectives during one step, read from the dispatcher instead of torch.profiler.

Every collective -- the Python API's (FSDP2, DeepSpeed, the Trainer's token count), DDP's C++ reducer,
DTensor's functional collectives (tp / cp / sp), pipeline send / recv -- reaches the dispatcher as a
``c10d`` or ``_c10d_functional`` op, so one dispatch mode sees them all. A ``c10d`` op returns its
``Work``: the interval runs from the issue to that work's future completing (gloo completes it when the
data has arrived). Some gloo works have no future (``reduce_scatter_tensor``, FSDP2's gradient reduction:
"Work::getFuture not implemented"); a thread of this mode looks at those every ``POLL_S`` until they report
completed. A functional collective has no work; its interval ends when ``wait_tensor`` returns.

Why not torch.profiler (what hftk used until 2026-12): its stop races gloo's worker threads, which
complete a collective's future before they end the collective's profiler record; a worker preempted in
between while the profiler stopped crashed a rank (SIGSEGV in ``_disable_profiler``, about one 2-rank
run in 170 on a loaded host). Here a worker thread touches nothing but a Python list, under the GIL, and
leaving the mode tears nothing down that a late callback could still reach.

On CUDA, NCCL's futures complete once the work is ordered on its stream, so these intervals would time
enqueueing: :func:`measures_transfer` says where the figure means time on the wire.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
POLL_S = 0.001  # how late a future-less work's end may be read


def measures_transfer(device: torch.device) -> bool:
    """True where a collective's future completes when its data has arrived (gloo on CPU)."""
    return device.type == "cpu"


class CollectiveTimer(TorchDispatchMode):
    """While entered (on the thread that runs the step; autograd's threads inherit it), every collective's
    ``(start, end)`` in ``perf_counter`` seconds lands in :attr:`spans`, from the completion callbacks too,
    which may run after the mode is left."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: list[tuple[float, float]] = []
        self._functional_started: dict[int, float] = {}  # id(output tensor) -> issue time
        self._unfutured: list[tuple[float, Any]] = []  # (issue time, work) of works without a future
        self._lock = threading.Lock()
        self._leaving = threading.Event()
        self._poller: threading.Thread | None = None

    def __exit__(self, *exc: Any) -> Any:
        """Leave the mode; the works without a future still running end now (the step waited for them)."""
        result = super().__exit__(*exc)
        self._leaving.set()
        if self._poller is not None:
            self._poller.join()
        return result

    def _watch(self, start: float, work: Any) -> None:
        with self._lock:
            self._unfutured.append((start, work))
            if self._poller is None:
                self._poller = threading.Thread(target=self._poll, name="hftk-collective-timer", daemon=True)
                self._poller.start()

    def _poll(self) -> None:
        while True:
            leaving = self._leaving.is_set()
            now = time.perf_counter()
            with self._lock:
                done = [(s, w) for s, w in self._unfutured if leaving or w.is_completed()]
                self._unfutured = [item for item in self._unfutured if item not in done]
                self.spans.extend((s, now) for s, _ in done)
            if leaving:
                return
            time.sleep(POLL_S)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace not in COLLECTIVE_NAMESPACES:
            return func(*args, **(kwargs or {}))
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        if func.namespace == "_c10d_functional":
            self._functional(func, start, args, out)
            return out
        works = [torch._C._distributed_c10d.Work.unbox(o) for o in tree_flatten(out)[0]
                 if isinstance(o, torch.ScriptObject)]
        if not works:  # a blocking op (barrier, monitored_barrier) is done when it returns
            self.spans.append((start, time.perf_counter()))
        for work in works:
            try:
                future = work.get_future()
            except RuntimeError:  # "Work::getFuture not implemented" (see the module docstring)
                self._watch(start, work)
                continue
            future.then(lambda _, begun=start: self.spans.append((begun, time.perf_counter())))
        return out

    def _functional(self, func: Any, start: float, args: Any, out: Any) -> None:
        name = func.__name__
        if name.startswith("wait_tensor"):
            begun = self._functional_started.pop(id(args[0]), None)
            if begun is not None:
                self.spans.append((begun, time.perf_counter()))
            return
        if name.startswith("_"):  # _wrap_tensor_autograd and the like: no communication of their own
            return
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._functional_started[id(tensor)] = start
