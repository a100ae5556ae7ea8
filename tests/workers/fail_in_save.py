"""``scripts/finetune.py`` whose save of one folder fails on one rank: ``HFTK_FAIL_SAVE=FOLDER:RANK:WHERE``.

- ``check``: that rank's completeness check of ``FOLDER`` (``final``) fails for real: hftk's own
  ``check_complete`` is asked for one more tensor than the folder holds, as when a weight was not gathered.
- ``enter``: that rank raises as it enters the strategy's save of ``FOLDER`` (``final``), while the others go
  on into its collectives (FSDP's gather, the pipeline's stage barrier).
- ``on_save``: that rank raises in an ``on_save`` callback of ``FOLDER`` (``checkpoint-N``, the Trainer's),
  while the others wait to publish it.

Every rank ignores SIGTERM, so no launcher stops a rank that waits (a launcher on another node hears of a
failed worker late, if ever): each rank must leave on its own. The failing rank prints
``hftk-test: fault at <unix time>`` first, for the test to time how long the others take.
"""

from __future__ import annotations

import functools
import inspect
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

from transformers.trainer_callback import CallbackHandler

from hftk.checkpoint import hf_folder
from hftk.run.prepare import main

FOLDER, RANK, WHERE = os.environ["HFTK_FAIL_SAVE"].split(":")
HERE = int(os.environ.get("RANK", "0")) == int(RANK)
MISSING = (["hftk_test.missing.weight"], (1,))


def fault() -> None:
    print(f"hftk-test: fault at {time.time()}", flush=True)


def failing_check(check: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(check)
    def check_one_more(folder: Path, expected: Any) -> None:
        if HERE and Path(folder).name == FOLDER:
            fault()
            expected = [*expected, MISSING]
        check(folder, expected)

    return check_one_more


def failing_entry(save: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(save)
    def enter(first: Any, out: Any, *args: Any, **kwargs: Any) -> None:  # (trainer, out) or (self, out, ...)
        if HERE and Path(out).name == FOLDER:
            fault()
            raise RuntimeError(f"injected: rank {RANK} fails entering the save of {FOLDER}")
        save(first, out, *args, **kwargs)

    return enter


def failing_on_save(on_save: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(on_save)
    def on_save_or_fail(self: Any, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if HERE and f"checkpoint-{state.global_step}" == FOLDER:
            fault()
            raise RuntimeError(f"injected: rank {RANK} fails in an on_save callback of {FOLDER}")
        return on_save(self, args, state, control, **kwargs)

    return on_save_or_fail


def install() -> None:
    if WHERE == "check":  # every hftk module that bound the check at import (mesh_checkpoint) and its own module
        original = hf_folder.check_complete
        for module in [m for name, m in sys.modules.items() if name.startswith("hftk.")]:
            if getattr(module, "check_complete", None) is original:
                module.check_complete = failing_check(original)
    elif WHERE == "enter":  # the Trainer engine's strategy modules and the loop engine's step classes
        for module in [m for name, m in sys.modules.items() if name.startswith("hftk.strategies.")]:
            if inspect.isfunction(getattr(module, "save_final", None)):
                module.save_final = failing_entry(module.save_final)
            for cls in vars(module).values():
                if inspect.isclass(cls) and cls.__module__ == module.__name__ and "save_final" in vars(cls):
                    cls.save_final = failing_entry(cls.save_final)
    else:
        CallbackHandler.on_save = failing_on_save(CallbackHandler.on_save)


if __name__ == "__main__":
    import importlib
    import pkgutil

    import hftk.strategies

    for info in pkgutil.iter_modules(hftk.strategies.__path__, "hftk.strategies."):  # each, before it is patched
        importlib.import_module(info.name)
    install()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(main())
