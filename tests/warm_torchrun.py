"""torchrun's command line on warm ranks (tests/warm.py), for programs that launch ranks themselves:
``python tests/warm_torchrun.py --nproc_per_node=N [--nnodes=1] (-m MODULE | SCRIPT) ARGS``.

The suite points ``hftk bench``'s launcher at it (``HFTK_BENCH_LAUNCHER``, hftk/bench/launch.py): the bench's
ranks are forked from the warm server at ``$HFTK_WARM_SOCKET`` with this process's environment, working
directory, stdout and stderr, and this process exits with the cell's status, as torchrun does. Standard
library only, so it starts in a fraction of a second; killing it (the bench's own timeout) kills the ranks.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path, from any working directory
from tests.warm import submit  # noqa: E402

SOCKET_ENV = "HFTK_WARM_SOCKET"


def main(argv: list[str]) -> int:
    nproc, at = 1, 0
    while at < len(argv) and argv[at].startswith("--"):
        name, _, value = argv[at][2:].partition("=")
        if name == "nproc_per_node":
            nproc = int(value)
        elif name != "nnodes" or value != "1":
            raise SystemExit(f"warm_torchrun: --{name}={value} is not supported (one node, --nproc_per_node)")
        at += 1
    program = argv[at:at + 2] if argv[at] == "-m" else argv[at:at + 1]
    request = {"program": program, "args": argv[at + len(program):], "nproc": nproc, "env": dict(os.environ),
               "cwd": os.getcwd(), "launcher": True}
    sys.stdout.flush()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        reader, _ = submit(conn, os.environ[SOCKET_ENV], request, [1, 2])
        conn.settimeout(None)
        line = reader.readline()
    if not line:
        print("warm_torchrun: the cell's supervisor died", file=sys.stderr)
        return 1
    return int(json.loads(line)["returncode"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
