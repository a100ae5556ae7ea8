"""Checkpoints no kill can corrupt, and finding the newest complete one.

A checkpoint is written into ``<output_dir>/.staging/checkpoint-N``; then every file and folder
is fsynced, a marker (``hftk_complete.json``: the step and every file with its size) is written
last, and the folder is renamed to ``<output_dir>/checkpoint-N`` (one atomic rename on one
filesystem). ``latest`` only picks folders whose marker lists files that are all present with
those sizes, so a kill at any moment leaves the previous checkpoints or the new one, never half.

The HF Trainer writes ``checkpoint-N`` itself: :func:`install_atomic_checkpoints` points
``args.output_dir`` at the staging root for one save plus its ``on_save`` callbacks, so every
file a strategy (DeepSpeed shards, FSDP DCP) or callback (compression state) writes "into the
checkpoint" lands in the staging folder; after a barrier the publisher renames it into place.
Loops without the Trainer (pipeline) call :func:`atomic_save`; any folder that must appear
whole (``final``) is written through :func:`staged_folder`.

Every such save is one :func:`saving` region: a failure on any rank, wherever in the save it strikes
(a strategy's check, a library's write, a callback), reaches every rank as one line within seconds and
every rank exits, none left in a collective the failing rank skipped (:mod:`hftk.comm.rank_failure`).
"""

from __future__ import annotations

import errno
import functools
import json
import os
import random
import re
import resource
import shutil
import sys
import time
import zipfile
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open

from hftk import __version__
from hftk.comm.rank_failure import FailureWatch, first_posted, watching
from hftk.core.errors import HftkError

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
COMPLETE_MARKER = "hftk_complete.json"  # written last, after every other file is on disk
STAGING_DIR = ".staging"  # under the output dir: same filesystem, so the publishing rename is atomic
RNG_FILE = "rng_state_{}.pth"  # one per rank, the Trainer's own name


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest to newest by step."""
    children = Path(output_dir).iterdir() if Path(output_dir).is_dir() else ()
    found = [(int(match.group(1)), child) for child in children
             if (match := CHECKPOINT_RE.match(child.name)) and child.is_dir() and is_complete(child)]
    return [path for _, path in sorted(found)]


def restart_count() -> int:
    """How many times torch elastic (torchrun / accelerate ``--max_restarts``) restarted this group."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def elastic_run_id() -> str | None:
    """The launcher's job identity (``--rdzv-id``, a uuid under ``--standalone``); None when it has none."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return run_id if run_id and run_id != "none" else None


def continues_this_job(output_dir: Path) -> bool:
    """True when this process group is a later round of the job that wrote the newest checkpoint.

    ``TORCHELASTIC_RESTART_COUNT`` only counts failures of this node's own workers: when another
    node's workers die, this node's agent re-forms the group as a membership change and its
    workers start with a count of 0. The run id in the checkpoint's seal tells them apart.
    """
    if restart_count() > 0:
        return True
    run_id, checkpoints = elastic_run_id(), list_checkpoints(output_dir)
    return (run_id is not None and bool(checkpoints)
            and json.loads((checkpoints[-1] / COMPLETE_MARKER).read_text()).get("elastic_run_id") == run_id)


def resolve_resume(output_dir: Path, value: str | None) -> str | None:
    """``latest`` -> newest complete checkpoint (or None to start fresh); a path passes through.

    After an elastic restart the newest complete checkpoint of this run wins over whatever the
    command line asked for: the group must continue where it died, not where it first started.
    """
    checkpoints = list_checkpoints(output_dir)
    if checkpoints and (continues_this_job(output_dir) or value == "latest"):
        return str(checkpoints[-1])
    return value if value and value != "latest" else None


def staging_root(output_dir: Path) -> Path:
    return Path(output_dir) / STAGING_DIR


def is_complete(folder: Path) -> bool:
    """The marker exists and every file it lists is present with its recorded size."""
    try:
        files = json.loads((Path(folder) / COMPLETE_MARKER).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return all(_size(Path(folder) / rel) == size for rel, size in files.items())


def check_resumable(folder: Path, field: str = "training.resume_from_checkpoint") -> None:
    """An explicit resume folder passes the same seal check as ``latest``, plus readable file headers.

    Raises one line naming the first file that is missing, has another size than the seal records,
    or whose header cannot be read (safetensors header and offsets, torch zip directory), before any
    process group: a damaged file would otherwise surface as a loader's traceback on every rank."""
    folder = Path(folder)
    fix = "resume from another checkpoint-N folder (or 'latest', the newest complete one)."
    try:
        files = json.loads((folder / COMPLETE_MARKER).read_text())["files"]
    except OSError:
        raise HftkError(field, f"{folder} has no {COMPLETE_MARKER}: its save never finished (or another tool wrote "
                        "it), so it may be incomplete.", fix) from None
    except (ValueError, KeyError, TypeError):
        raise HftkError(field, f"{folder / COMPLETE_MARKER} is damaged (not hftk's seal).", fix) from None
    for rel, size in sorted(files.items()):
        actual = _size(folder / rel)
        if actual != size:
            now = "is missing" if actual < 0 else f"has {actual} bytes"
            raise HftkError(field, f"{folder / rel} {now}; the seal records {size} bytes (damaged checkpoint).", fix)
        if problem := _header_problem(folder / rel):
            raise HftkError(field, f"{folder / rel} is damaged: {problem}.", fix)


def _header_problem(path: Path) -> str | None:
    """Why ``path``'s header cannot be read (safetensors, or torch's zip format); None when it can or has none."""
    if path.suffix == ".safetensors":
        try:
            with safe_open(str(path), "pt") as f:  # parses the header and checks its offsets fit the file
                f.keys()
        except Exception as exc:  # SafetensorError and friends: the message is all the user needs
            return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    elif path.suffix in (".pt", ".pth", ".bin") and not zipfile.is_zipfile(path):
        return "not a torch zip archive"
    return None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def _fsync(path: Path) -> None:
    """Flush one file or folder entry to stable storage (folders too: renames live in them)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seal(folder: Path, step: int | None, global_batch: int | None = None) -> None:
    """fsync every file and folder under ``folder``, then write the completion marker last.

    The marker also records the world size that wrote the folder and, from the Trainer, the global
    batch (samples per optimizer step): a resume at another world size is checked against them."""
    folder = Path(folder)
    (folder / COMPLETE_MARKER).unlink(missing_ok=True)
    files: dict[str, int] = {}
    for root, _, names in os.walk(folder):
        for name in sorted(names):
            path = Path(root) / name
            _fsync(path)
            files[path.relative_to(folder).as_posix()] = path.stat().st_size
        _fsync(Path(root))
    marker = {"step": step, "files": files, "hftk_version": __version__, "sealed_at": time.time(),
              "elastic_run_id": elastic_run_id(), "world_size": _world(), "global_batch": global_batch}
    tmp = folder / f"{COMPLETE_MARKER}.tmp"
    with open(tmp, "w") as f:
        json.dump(marker, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / COMPLETE_MARKER)
    _fsync(folder)


def retire(folder: Path) -> None:
    """Delete a published folder so that a kill mid-delete never leaves a "complete" remnant."""
    (Path(folder) / COMPLETE_MARKER).unlink(missing_ok=True)
    _fsync(Path(folder))
    shutil.rmtree(folder)


def publish(staged: Path, final: Path, step: int | None, global_batch: int | None = None) -> None:
    """Seal ``staged`` and rename it to ``final`` (an older folder of that name is retired first)."""
    if not staged.exists() and is_complete(final):
        return  # another node's publisher already renamed this shared folder
    seal(staged, step, global_batch)
    if final.exists():
        retire(final)
    os.rename(staged, final)
    _fsync(final.parent)
    if not any(staged.parent.iterdir()):
        staged.parent.rmdir()  # an empty staging folder would only puzzle whoever looks at the output dir


def rotate(output_dir: Path, limit: int | None, protect: tuple[str | None, ...] = ()) -> None:
    """Keep the newest ``limit`` complete checkpoints (None or <= 0: keep all) plus ``protect``."""
    checkpoints = list_checkpoints(output_dir)
    if not limit or limit <= 0 or len(checkpoints) <= limit:
        return
    protected = {Path(p).resolve() for p in protect if p}
    for checkpoint in checkpoints[:-limit]:
        if checkpoint.resolve() not in protected:
            retire(checkpoint)


def announce_resume(output_dir: Path, resume: str | None, publisher: bool, world_size: int | None = None) -> None:
    """Before training (publisher only): drop what saves cut short by a kill left, say where training starts
    (and, given this launch's ``world_size``, what a resume at another world size does not carry over)."""
    if not publisher:
        return
    root = staging_root(output_dir)
    for leftover in sorted(root.iterdir()) if root.is_dir() else []:
        if leftover.is_dir():
            shutil.rmtree(leftover)
        else:
            leftover.unlink()
        print(f"hftk: discarded incomplete save {leftover}", file=sys.stderr, flush=True)
    if resume:
        why = f" (elastic restart {restart_count()})" if restart_count() else ""
        saved = saved_world(Path(resume))[0]
        if world_size and saved not in (None, world_size):  # validate let it through: same global batch, resharded
            why += (f" (saved by {saved} ranks, resumed on {world_size} with the same global batch: weights, optimizer, "
                    "scheduler and data position continue exactly; per-rank random generators, e.g. dropout's, do not)")
        print(f"hftk: resuming from {resume}{why}", file=sys.stderr, flush=True)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def saved_world(folder: Path) -> tuple[int | None, int | None]:
    """(world size, global batch) that wrote checkpoint ``folder``, None where unknown.

    From the seal; a checkpoint sealed before it recorded them tells its world size by its RNG
    files (one ``rng_state_<rank>.pth`` per rank, the Trainer's ``rng_state.pth`` on one process)."""
    try:
        marker = json.loads((Path(folder) / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        marker = {}
    world = marker.get("world_size")
    if world is None:
        ranks = len(list(Path(folder).glob(RNG_FILE.format("*"))))
        world = ranks or (1 if (Path(folder) / "rng_state.pth").is_file() else None)
    return world, marker.get("global_batch")


def _barrier() -> None:
    if _world() > 1:
        dist.barrier()


def save_rng(folder: Path) -> None:
    """This rank's four generators (python, numpy, torch CPU, every CUDA device) into ``folder``.

    For loops without the Trainer (which saves the same set itself): dropout and any sampling
    continue identically after a resume only when all of them are restored. The numpy key is kept
    as a tensor so the file loads with ``weights_only=True``.
    """
    name, key, *rest = np.random.get_state()
    state = {"python": random.getstate(), "cpu": torch.random.get_rng_state(),
             "numpy": (name, torch.from_numpy(key.astype(np.int64)), *rest)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.random.get_rng_state_all()
    torch.save(state, Path(folder) / RNG_FILE.format(_rank()))


def load_rng(folder: Path) -> bool:
    """Restore what :func:`save_rng` wrote for this rank; False when ``folder`` has no file for it
    (a resume on more ranks than saved: the new ranks keep their seeded generators)."""
    file = Path(folder) / RNG_FILE.format(_rank())
    if not file.exists():
        return False
    state = torch.load(file, weights_only=True)
    random.setstate(state["python"])
    name, key, *rest = state["numpy"]
    np.random.set_state((name, key.numpy().astype(np.uint32), *rest))
    torch.random.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.random.set_rng_state_all(state["cuda"])
    return True


@contextmanager
def staged_folder(final: Path, publisher: bool, step: int | None = None,
                  global_batch: int | None = None) -> Iterator[Path]:
    """Collective: every rank writes into the yielded staging folder; on exit it appears as ``final``.

    Nothing is published when the body raises on any rank: ``final`` keeps its previous content, if any,
    and every rank raises the one line (:func:`saving`).
    """
    final = Path(final)
    staged = staging_root(final.parent) / final.name
    with saving(final, staged, publisher) as watch:
        if publisher:
            if staged.exists():
                shutil.rmtree(staged)
            staged.mkdir(parents=True)
        _barrier()
        with _settled(final, staged, publisher, watch):
            yield staged
        if publisher:
            with watch.uncut():
                publish(staged, final, step, global_batch)
        _barrier()  # nobody moves on before the folder is in place


class SaveFailed(HftkError):
    """A save's failure as every rank reports it: already the one line (never described again)."""


@contextmanager
def saving(final: Path, staged: Path, publisher: bool) -> Iterator[FailureWatch]:
    """Collective: one save of ``final`` (written into ``staged``), from its start to its publication.

    Any rank's failure in it reaches every rank as one line (:func:`save_failure`): ranks that meet at
    the settle (:func:`settle_write`) raise it there; a rank left waiting in a collective that the failing
    rank skipped (a library's gather or barrier) reports it within seconds and exits
    (:class:`hftk.comm.rank_failure.FailureWatch`), the publisher after removing the staged folder.
    """
    with watching(functools.partial(save_failure, final, staged), choose=_reported,
                  on_stuck=functools.partial(_discard, staged) if publisher else None) as watch:
        yield watch


_held_failures: list[BaseException] | None = None  # while a save runs: this rank's write failures, held


def held_until_settled(write: Callable[..., Any]) -> Callable[..., Any]:
    """``write`` (one rank's file write inside a library's save), whose failure during a save is held
    until the save settles instead of raised at once.

    A library's save puts collectives after its rank-local writes (DeepSpeed's barriers after each
    rank's partition file; FSDP's gathers after rank 0's model file). A rank leaving at its failed
    write would leave the others in that collective for the whole process-group timeout; holding the
    failure keeps every rank on the same collectives to :func:`settle_write`, which reports it."""

    @functools.wraps(write)
    def hold(*args: Any, **kwargs: Any) -> Any:
        if _held_failures is None:
            return write(*args, **kwargs)
        try:
            return write(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 -- every failed write is settled, named or raised, there
            _held_failures.append(exc)
            return None

    return hold


@contextmanager
def holding_write_failures() -> Iterator[None]:
    """Hold failures of :func:`held_until_settled` writes for the body; raise the first one at its end (also
    when the body raised later)."""
    global _held_failures
    _held_failures = held = []
    try:
        yield
    except BaseException as exc:
        if held:  # what failed later (a check of the file that was not written) follows from the held failure
            raise held[0] from exc
        raise
    finally:
        _held_failures = None
    if held:
        raise held[0]


SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a full disk, a full quota, a file size limit
ROOM_FIX = ("free space there (or raise the file size limit, `ulimit -f`), then rerun with "
            "--resume_from_checkpoint latest.")  # a failure that ran out of room says this


@contextmanager
def _settled(final: Path, staged: Path, publisher: bool, watch: FailureWatch) -> Iterator[None]:
    """Collective: the body writes this rank's part of ``staged`` (write failures held to its end,
    :func:`held_until_settled`); its failure (or none) is settled on every rank by :func:`settle_write`. An
    interpreter stop passes straight through; not just ``Exception`` is settled: DCP gathers every rank's
    write failure into a ``CheckpointException``, which derives from ``BaseException``."""
    try:
        with holding_write_failures():
            yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:
        settle_write(final, staged, watch.fail(exc, functools.partial(save_failure, final, staged)), publisher, watch)
    settle_write(final, staged, None, publisher, watch)


def settle_write(final: Path, staged: Path, failure: HftkError | None, publisher: bool, watch: FailureWatch) -> None:
    """Collective, once every rank has written (or failed to write) its part of ``staged``.

    Every rank meets the others with its failure line (None when it wrote everything) through the store
    (:meth:`FailureWatch.settle`: a rank that failed never enters a collective the others are not in). When any
    rank failed, the staged folder is removed (the previous checkpoints, ``latest`` and ``final`` stay as they
    were) and every rank raises one line (:func:`save_failure`, :func:`_reported`).
    """
    reported = watch.settle(failure)
    if reported is None:
        return
    if publisher:
        _discard(staged)
    watch.own_stack(reported)
    raise SaveFailed(reported.field, reported.problem, reported.fix)


def _reported(failures: list[tuple[int, HftkError]]) -> HftkError:
    """The line every rank reports when several failed: a full disk's (the lowest rank's: the others may only
    have read of it, DCP's exception carries every rank's), as it explains the others; else the first posted."""
    rooms = [(rank, failure) for rank, failure in failures if failure.fix == ROOM_FIX]
    return min(rooms, key=lambda room: room[0])[1] if rooms else first_posted(failures)


def _discard(staged: Path) -> None:
    """Remove an unfinished save (and the staging root once empty)."""
    shutil.rmtree(staged, ignore_errors=True)
    if staged.parent.is_dir() and not any(staged.parent.iterdir()):
        staged.parent.rmdir()


def save_failure(final: Path, staged: Path, error: BaseException) -> HftkError:
    """The one line every rank reports when ``error`` (this rank's) stopped the save of ``final``.

    A write that ran out of room (disk full, quota, ``RLIMIT_FSIZE``) names the folder and the bytes it
    needs; an hftk error keeps its field and fix, said of this save and rank; anything else (a bug) is
    named by its type and message, raised from it (its stack is printed on its rank when the line reported is
    this one: :meth:`FailureWatch.own_stack`).
    """
    if isinstance(error, SaveFailed):
        return error
    where = f"saving {final} failed" + (f" on rank {_rank()}" if _world() > 1 else "")
    if room := _out_of_room(final, staged, error):
        return SaveFailed("training.output_dir", room, ROOM_FIX)
    if isinstance(error, HftkError):
        return SaveFailed(error.field, f"{where}: {error.problem} ({_kept(final)})", error.fix)
    message = str(error).strip().splitlines()
    failure = SaveFailed("training.output_dir", f"{where}: {type(error).__name__}"
                         f"{': ' + message[0] if message else ''} ({_kept(final)}).",
                         f"the traceback above (rank {_rank()}) shows where; fix that, then rerun.")
    failure.__cause__ = error  # the stack the line points at (FailureWatch.own_stack)
    return failure


def _kept(final: Path) -> str:
    """What the user still has after a failed save of ``final``."""
    if CHECKPOINT_RE.match(final.name):
        latest = list_checkpoints(final.parent)
        return f"{latest[-1].name} is intact and still the latest" if latest else "no earlier checkpoint exists"
    return f"{final} keeps its previous content" if final.exists() else f"nothing was written to {final}"


def _out_of_room(final: Path, staged: Path, error: BaseException) -> str | None:
    """The problem line when ``error`` (a failed write into ``staged``) means the disk had no room; else None.

    The errno when the writer kept it (Python's ``OSError``, safetensors' "(os error N)"); torch's zip
    writer reports a refused write only as a position mismatch, so the limits themselves are checked
    then: free bytes on the filesystem and ``RLIMIT_FSIZE`` against what the checkpoint needs.
    """
    total, largest, source = _needed_bytes(final, staged)
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    free = shutil.disk_usage(staged if staged.exists() else final.parent).free
    code = _space_errno(error)
    if code is None and free < total:
        code = errno.ENOSPC
    if code is None and soft != resource.RLIM_INFINITY and soft < largest:
        code = errno.EFBIG
    if code is None:
        return None
    why = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
           errno.EFBIG: "a file outgrew the file size limit"}[code]
    if code == errno.EFBIG and soft != resource.RLIM_INFINITY:
        why += f" (RLIMIT_FSIZE: {soft} bytes per file)"
    return (f"saving {final} failed: {why}. It needs about {total} bytes ({source}), {free} bytes are free "
            f"there; the unfinished save was removed, {_kept(final)}.")


def _space_errno(error: BaseException | None) -> int | None:
    """ENOSPC / EDQUOT / EFBIG from ``error`` or what it was raised from (errno, or its text)."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in SPACE_ERRNOS:
            return error.errno
        for code in SPACE_ERRNOS:
            if os.strerror(code) in str(error):  # safetensors: "I/O error: File too large (os error 27)"
                return code
        error = error.__cause__ or error.__context__
    return None


def _needed_bytes(final: Path, staged: Path) -> tuple[int, int, str]:
    """(total, largest file, where that comes from): the newest complete checkpoint's sealed sizes,
    else what this save had written before it failed (a lower bound)."""
    checkpoints = list_checkpoints(final.parent)
    if checkpoints:
        sizes = list(json.loads((checkpoints[-1] / COMPLETE_MARKER).read_text())["files"].values())
        return sum(sizes), max(sizes, default=0), f"the size of {checkpoints[-1].name}"
    sizes = [max(_size(Path(root) / name), 0) for root, _, names in os.walk(staged) for name in names]
    return sum(sizes), max(sizes, default=0), "at least what was written before the write failed"


def atomic_save(output_dir: Path, step: int, write: Callable[[Path], None], save_total_limit: int | None = None,
                global_batch: int | None = None) -> Path:
    """Collective atomic ``checkpoint-<step>`` for loops without the Trainer: ``write(folder)`` writes this rank's files.

    Rank 0 publishes and then keeps the newest ``save_total_limit`` complete checkpoints. A loop whose
    checkpoints reshard gives ``global_batch``, sealed so a resume at another world size can keep it.
    """
    final = Path(output_dir) / f"checkpoint-{step}"
    with staged_folder(final, publisher=_rank() == 0, step=step, global_batch=global_batch) as folder:
        write(folder)
    if _rank() == 0:
        rotate(output_dir, save_total_limit, protect=(str(final),))
    return final


def install_atomic_checkpoints(trainer: Any, after_publish: Callable[[Path], None] | None = None) -> None:
    """Make every checkpoint of this Trainer atomic; ``after_publish(folder)`` runs on the publisher.

    Instance-level hooks, no subclass (strategies may bring their own Trainer class):
    ``_save_checkpoint`` runs with ``args.output_dir`` pointing at the staging root (write failures
    held to its end, :func:`held_until_settled`; ``_save``, rank 0's model file, is one), and
    ``callback_handler.on_save`` publishes once every ``on_save`` callback has written its files.
    Both run in one :func:`saving` region: a failure on any rank, there or in a callback, reaches every
    rank. The Trainer's own rotation sees only the staging folder; :func:`rotate` applies
    ``save_total_limit`` to complete checkpoints, and only after the new one is in place.
    """
    save_checkpoint = trainer._save_checkpoint
    on_save = trainer.callback_handler.on_save
    current: dict[str, Any] = {}  # the save in progress: its folders and region (an ExitStack), until published

    def staged_save_checkpoint(model: Any, trial: Any) -> None:
        output_dir = Path(trainer.args.output_dir)
        staged = staging_root(output_dir) / f"checkpoint-{trainer.state.global_step}"
        final, publisher = output_dir / staged.name, trainer.args.should_save
        region = ExitStack()
        watch = region.enter_context(saving(final, staged, publisher))
        current.update(output_dir=output_dir, staged=staged, region=region, watch=watch)
        try:
            if publisher and staged.exists():
                shutil.rmtree(staged)  # a save of this step cut short before a restart
            _barrier()
            trainer.args.output_dir = str(staging_root(output_dir))
            with _settled(final, staged, publisher, watch):
                save_checkpoint(model, trial)
        except BaseException:
            trainer.args.output_dir = str(output_dir)
            current.clear()
            with region:  # the region posts the failure and raises it as the one line
                raise

    def on_save_then_publish(args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if not current:
            return on_save(args, state, control, **kwargs)
        save = dict(current)
        current.clear()
        with save["region"]:
            try:
                control = on_save(args, state, control, **kwargs)
            finally:
                trainer.args.output_dir = str(save["output_dir"])
            _publish_trainer_checkpoint(trainer, save["output_dir"], save["staged"], save["watch"], after_publish)
        return control

    trainer._save_checkpoint = staged_save_checkpoint
    trainer._save = held_until_settled(trainer._save)  # rank 0's model file, before the optimizer's collectives
    trainer.callback_handler.on_save = on_save_then_publish


def _publish_trainer_checkpoint(trainer: Any, output_dir: Path, staged: Path, watch: FailureWatch,
                                after_publish: Callable[[Path], None] | None) -> None:
    state, args = trainer.state, trainer.args
    final = output_dir / staged.name
    best = state.best_model_checkpoint
    if best and Path(best).parent == staged.parent:  # the Trainer recorded the staging path
        state.best_model_checkpoint = str(output_dir / Path(best).name)
    _barrier()  # every rank's files are in the staging folder
    if args.should_save:
        if best != state.best_model_checkpoint and (staged / "trainer_state.json").exists():
            state.save_to_json(str(staged / "trainer_state.json"))
        with watch.uncut():
            publish(staged, final, state.global_step,
                    global_batch=args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size)
        rotate(output_dir, args.save_total_limit, protect=(state.best_model_checkpoint, str(final)))
        if after_publish is not None:
            after_publish(final)
    _barrier()
