"""Warm ranks: a test's ranks forked from a server that has already imported the whole stack.

A launch through torchrun pays 11-21 s per rank of imports (torch, transformers, peft, datasets,
deepspeed, hftk) for about a second of training. The server here (``python -m tests.warm SOCKET``)
imports all of that once; for each cell a client asks it for N ranks of a script or module, and
it forks a supervisor (a new session, so a timeout kills it with its ranks) that does what
torchrun's agent does: it hosts the agent store on a fresh port and forks the ranks with the
launcher's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` / ``MASTER_PORT``,
``TORCHELASTIC_*``), each running the program as ``__main__`` through :mod:`runpy`. Each rank is
a fresh fork of the server's pristine state, so nothing a cell leaves behind (a process group, a
patched module, an environment variable, an SDPA entry) reaches the next cell.

Libraries read some variables once, at import (``HF_ENDPOINT``, ``HF_HUB_OFFLINE``, glibc's
``MALLOC_*``): a cell whose environment differs from the test process's in anything but the
launcher's variables and those read when a run uses them (hftk's ``HFTK_*``, accelerate's
``ACCELERATE_*`` / ``FSDP_*``, read when its state is built, wandb's ``WANDB_*``, read by ``wandb.init``,
torch's ``PYTORCH_NVML_BASED_CUDA_CHECK``, read when CUDA is asked for; pytest's own) gets a server
started with that environment (one per distinct difference, kept for the session; each pytest-xdist
worker has its own servers).

Programs that start ranks themselves (``hftk bench``) use :mod:`tests.warm_torchrun`, torchrun's command line
on this server.

Launch behaviour itself (the README's first command, ``accelerate launch`` guards, elastic restarts,
SIGKILL / SIGTERM, multi-node, SLURM) keeps the real launchers; everything else runs here.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# What torchrun's agent sets for each worker; the harness sets them, so they never pick a server.
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
               "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
               "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
               "TORCH_NCCL_ASYNC_ERROR_HANDLING", "PYTHONUNBUFFERED")
# Everything a cell may import, imported once by the server (hftk's own modules are walked below).
PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.pipelining",
           "torch.distributed.tensor.parallel", "torch.distributed.checkpoint", "transformers", "transformers.trainer",
           "accelerate", "peft", "datasets", "deepspeed", "trl", "trl.trainer.utils", "trl.trainer.sft_trainer",
           "trl.data_utils", "bitsandbytes", "safetensors.torch", "rich.console",
           "huggingface_hub", "wandb", "torch.utils.tensorboard", "matplotlib.pyplot")
READ_WHEN_USED = ("HFTK_", "ACCELERATE_", "FSDP_", "WANDB_", "PYTORCH_NVML_BASED_CUDA_CHECK", "PYTEST_",
                  "TORCHINDUCTOR_CACHE_DIR")
# A server for references that must owe nothing to hftk (tests/reference/plain.py checks that no hftk module
# is loaded): the libraries only.
PRELOAD_PLAIN = ("torch", "transformers", "transformers.trainer", "accelerate", "datasets", "safetensors.torch")
GRACE_S = 5.0
FAILED_RANKS = "warm launch: ranks failed (rank: exit code or -signal):"  # after one rank fails: SIGTERM to the others, then SIGKILL (torchrun does the same)
READY_TIMEOUT_S = 600.0


# ----------------------------------------------------------------------------------------------
# Server side
# ----------------------------------------------------------------------------------------------

def preload(plain: bool) -> None:
    """Import the stack and every hftk module (so a cell imports nothing heavy of its own); ``plain``: the
    libraries of :data:`PRELOAD_PLAIN` only."""
    import importlib
    import pkgutil

    for name in PRELOAD_PLAIN if plain else PRELOAD:
        importlib.import_module(name)
    if not plain:
        import hftk

        for info in pkgutil.walk_packages(hftk.__path__, "hftk."):
            importlib.import_module(info.name)
    # Tables a process builds at its first from_pretrained (~1,000 regexes, 0.2 s of a cell), built once here.
    importlib.import_module("transformers.conversion_mapping").get_checkpoint_conversion_mapping("gpt2")
    if not plain:
        _cpu_info_once()
    gc.freeze()  # the imported heap is never collected: a rank's gc.collect() (0.4 s in every Trainer) skips it


def _cpu_info_once() -> None:
    """py-cpuinfo asked once: DeepSpeed's CPU op builder (cpu_adam, every ZeRO offload cell) calls
    ``cpuinfo.get_cpu_info`` three times per load, each a ~1.1 s subprocess; the CPU does not change
    between cells, so each call returns a copy of this machine's answer."""
    import copy

    import cpuinfo

    answer = cpuinfo.get_cpu_info()
    cpuinfo.get_cpu_info = lambda: copy.deepcopy(answer)


def free_port() -> int:
    # not hftk.bench.launch.free_port: this module runs the plain server too, which must not import hftk
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(request: dict[str, Any], rank: int, port: int, run_id: str, fds: list[int]) -> None:
    """One rank: the launcher's environment, the client's files as stdout / stderr, the program as
    ``__main__``; leaves the way a finished interpreter does (threads joined, exit handlers run)."""
    import runpy

    for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
    nproc = request["nproc"]
    os.environ.clear()
    os.environ.update(request["env"])
    if request["launcher"]:
        os.environ.update({
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nproc),
            "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    _own_wandb_media_dir()
    os.chdir(request["cwd"])
    for fd, target in zip(fds, (1, 2)):
        os.dup2(fd, target)
    # A crashing rank leaves its Python stacks in the cell's output, through a descriptor of its own (a
    # filter that points fd 2 elsewhere for a while cannot swallow them).
    faulthandler.enable(os.fdopen(os.dup(2), "w"), all_threads=True)
    program, args = request["program"], request["args"]
    code: int = 1
    try:
        if program[0] == "-m":
            sys.argv = [program[1], *args]
            sys.path[0] = request["cwd"]
            sys.modules.pop(program[1], None)  # preloaded: `python -m` runs it afresh as __main__ (no runpy warning)
            runpy.run_module(program[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [program[0], *args]
            sys.path[0] = str(Path(program[0]).resolve().parent)
            runpy.run_path(program[0], run_name="__main__")
        code = 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 -- what an uncaught exception does to a fresh interpreter
        traceback.print_exc()
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # join non-daemon threads, as interpreter exit does
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 -- a closed stream has nothing left to write
                pass
        os._exit(code)


def _own_wandb_media_dir() -> None:
    """wandb stages tables and images in a TemporaryDirectory made when it is imported -- here once, in the
    server -- and deletes it when a process exits: a fresh interpreter owns its own. So does each fork: the
    inherited finalizer is detached (the server's folder is not this rank's to delete) and the rank gets a
    folder of its own, removed at its exit."""
    private = sys.modules.get("wandb.sdk.data_types._private")
    if private is None:
        return
    private.MEDIA_TMP._finalizer.detach()
    private.MEDIA_TMP.name = tempfile.mkdtemp("wandb-media")
    atexit.register(shutil.rmtree, private.MEDIA_TMP.name, ignore_errors=True)


def supervise(conn: socket.socket, request: dict[str, Any], fds: list[int], key: tuple[tuple[str, str], ...]) -> None:
    """The cell's agent: its own session, the agent store, N forked ranks, torchrun's exit status. A request
    whose environment needs another server (``key``: this one's, see :func:`server_key`) is refused, and a
    client that goes away (killed on its own timeout) takes the ranks with it."""
    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    conn.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
    differs = sorted(k for k in set(dict(key)) | set(dict(server_key(request["env"])))
                     if dict(key).get(k) != request["env"].get(k))
    if differs:
        os.write(fds[1], f"warm launch refused: this server was started without the cell's {', '.join(differs)}; "
                         f"start one with that environment (tests.warm.server_for)\n".encode())
        conn.sendall(json.dumps({"returncode": 2}).encode() + b"\n")
        os._exit(0)
    nproc, store = request["nproc"], None
    port, run_id = free_port(), uuid.uuid4().hex
    pids = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            conn.close()
            rank_main(request, rank, port, run_id, fds)
        pids[pid] = rank
    if request["launcher"]:  # after the forks: no rank inherits the store's server thread (its clients retry)
        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # the agent's store
    codes: dict[int, int] = {}
    deadline = None
    while len(codes) < nproc:
        if deadline is not None and time.monotonic() > deadline:
            for pid in pids:
                if pids[pid] not in codes:
                    os.kill(pid, signal.SIGKILL)
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            if _client_gone(conn):
                for other in pids:
                    if pids[other] not in codes:
                        os.kill(other, signal.SIGKILL)
                os._exit(1)
            time.sleep(0.05)
            continue
        if pid not in pids:
            continue
        codes[pids[pid]] = os.waitstatus_to_exitcode(status)
        if codes[pids[pid]] != 0 and deadline is None:
            deadline = time.monotonic() + GRACE_S
            for other, rank in pids.items():
                if rank not in codes:
                    os.kill(other, signal.SIGTERM)
    failed = {rank: code for rank, code in sorted(codes.items()) if code != 0}
    if failed and request["launcher"]:
        os.write(fds[1], f"{FAILED_RANKS} {json.dumps(failed)}\n{last_words(fds)}".encode())
        returncode = 1  # torchrun's status when a worker failed
    else:
        returncode = next(iter(failed.values()), 0)
    del store
    conn.sendall(json.dumps({"returncode": returncode}).encode() + b"\n")
    os._exit(0)


LAST_WORDS = "warm launch: what the failed ranks left (a signal's stacks first, then the last tracebacks):"
LAST_WORDS_CHARS = 4000  # within the 6,000-character tails the tests print on failure


def last_words(fds: list[int]) -> str:
    """The failed ranks' own last words, repeated after the ranks' exit codes: faulthandler's stacks of a rank a
    signal ended, then the last two Python tracebacks, so a tail of the mixed output still holds them."""
    text = "".join(os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace") for fd in fds)
    fatal = [block.strip()[:2000] for block in re.findall(r"Fatal Python error:.*?(?=\nExtension modules:|\Z)", text, re.S)]
    tracebacks = [block.strip() for block in re.findall(r"Traceback \(most recent call last\):.*?\n(?=\S)[^\n]*",
                                                          text, re.S)][-2:]
    if not fatal and not tracebacks:
        return ""
    return f"{LAST_WORDS}\n" + "\n".join([*fatal, *tracebacks])[-LAST_WORDS_CHARS:] + "\n"


def _client_gone(conn: socket.socket) -> bool:
    """The client closed its end (it sends nothing after its request): readable with nothing to read."""
    readable, _, _ = select.select([conn], [], [], 0)
    return bool(readable) and conn.recv(1, socket.MSG_PEEK) == b""


def serve(path: str, plain: bool) -> None:
    """Preload, then fork a supervisor for every request until the test process goes away."""
    parent = os.getppid()
    key = server_key(dict(os.environ))  # what a cell's environment must match (before the settings below)
    # pyarrow's bundled jemalloc starts a background thread at load; a fork copies its locks but not the
    # thread, and ranks forked from here crashed (SIGSEGV) now and then. The server must fork single-threaded.
    os.environ["JE_ARROW_MALLOC_CONF"] = "background_thread:false"
    preload(plain)
    threads = [(Path("/proc/self/task") / t / "comm").read_text().strip() for t in os.listdir("/proc/self/task")]
    if len(threads) > 1:
        raise SystemExit(f"warm server: the preloaded libraries started threads {threads}; forking them is unsafe")
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # appears only once the server accepts
    listener.listen(8)
    listener.settimeout(1.0)
    while os.getppid() == parent:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        message, fds, _, _ = socket.recv_fds(conn, 1 << 16, 2)
        while len(message) < 8 + int.from_bytes(message[:8], "big"):
            message += conn.recv(1 << 16)
        if os.fork() == 0:
            listener.close()
            supervise(conn, json.loads(message[8:]), fds, key)
        conn.close()
        for fd in fds:
            os.close(fd)


# ----------------------------------------------------------------------------------------------
# Client side (the test process)
# ----------------------------------------------------------------------------------------------

class Server:
    """One warm server process, started with ``env``."""

    def __init__(self, env: dict[str, str], plain: bool) -> None:
        self.env, self.plain, self.cells = env, plain, 0
        self.dir = Path(tempfile.mkdtemp(prefix="hftk-warm-"))
        self.path = str(self.dir / "sock")
        self.log = self.dir / "server.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.warm", self.path, *(["plain"] if plain else [])], cwd=ROOT, env=env,
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"warm server did not start ({self.proc.poll()}):\n{self.log.read_text()[-4000:]}")
            time.sleep(0.1)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


_servers: dict[tuple[bool, tuple[tuple[str, str], ...]], Server] = {}


def cell_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a cell runs with: the test process's, unbuffered, plus ``extra``."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **(extra or {})}


def server_key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of ``env`` a server must have been started with (see the module docstring)."""
    return tuple(sorted((k, v) for k, v in env.items() if k not in LAUNCH_VARS and not k.startswith(READ_WHEN_USED)))


def server_for(env: dict[str, str], plain: bool = False) -> Server:
    """The server for ``env`` (``plain``: without hftk), started now if there is none yet."""
    key = (plain, server_key(env))
    if key not in _servers:
        _servers[key] = Server({**dict(key[1]), "PYTHONUNBUFFERED": "1"}, plain)
    return _servers[key]


def summary() -> list[str]:
    """One line per server: how many cells it ran, and how its environment differs from the first's."""
    servers = list(_servers.values())
    lines = []
    for i, server in enumerate(servers):
        differs = sorted(k for k in set(server.env) | set(servers[0].env) if server.env.get(k) != servers[0].env.get(k))
        lines.append(f"warm server {i}{' (plain)' if server.plain else ''}: {server.cells} cells"
                     + (f", environment differs in {', '.join(differs)}" if differs else ""))
    return lines


def shutdown() -> None:
    """Stop every server (their cell counts stay for :func:`summary`)."""
    for server in _servers.values():
        server.close()


def submit(conn: socket.socket, path: str, request: dict[str, Any], fds: list[int]) -> tuple[Any, int]:
    """Send ``request`` with ``fds`` (the ranks' stdout and stderr) to the server at ``path``: the reader of its
    replies (the exit status comes as the next line) and the supervisor's pid (its process group: the cell)."""
    conn.connect(path)
    message = json.dumps(request).encode()
    socket.send_fds(conn, [len(message).to_bytes(8, "big") + message], fds)
    reader = conn.makefile("rb")
    conn.settimeout(60)
    return reader, json.loads(reader.readline())["pid"]


def launch(program: list[str], args: list[str], nproc: int, timeout: float, env: dict[str, str] | None = None,
           cwd: Path | None = None, launcher: bool = True, plain: bool = False) -> tuple[int, str, str]:
    """Run ``program`` (``[script]`` or ``["-m", module]``) with ``args`` on ``nproc`` warm ranks, as
    ``torchrun --nproc_per_node nproc`` would (``launcher=False``: one plain process, as ``python``), on a
    server that has imported hftk (``plain``: one that has not).
    Returns (exit status, stdout, stderr); a cell past ``timeout`` is killed with its ranks and the
    AssertionError carries its output."""
    full_env = cell_env(env)
    server = server_for(full_env, plain)
    server.wait_ready()
    server.cells += 1
    request = {"program": program, "args": [str(a) for a in args], "nproc": nproc, "env": full_env,
               "cwd": str(cwd or ROOT), "launcher": launcher}
    with tempfile.TemporaryFile("w+b") as out, tempfile.TemporaryFile("w+b") as err, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        reader, pid = submit(conn, server.path, request, [out.fileno(), err.fileno()])
        conn.settimeout(max(timeout, 1))
        try:
            line = reader.readline()
        except TimeoutError:
            line = b""
            timed_out = True
        else:
            timed_out = False
        if not line:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode(errors="replace"))
        if not line:
            what = f"timed out after {timeout}s" if timed_out else "its supervisor died"
            raise AssertionError(f"warm launch {what}: {program} {args}\n{texts[0][-3000:]}\n{texts[1][-3000:]}")
        return json.loads(line)["returncode"], texts[0], texts[1]


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:] == ["plain"])
