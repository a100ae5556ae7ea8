"""Two hosts on one machine: network namespaces joined by a veth pair (when root), else loopback.

Traffic rule: the namespace addresses are only ever connected to from INSIDE the namespaces
(`ip netns exec`); from the root namespace a 10.x address would be routed off the machine.
Each namespace gets its own /etc/hosts (via /etc/netns/NAME/hosts) and hostname (unshare --uts)
so gloo and the rendezvous resolve the node names to the veth addresses, not to 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tests.helpers import ROOT, free_port, require_ranks, torchrun_command

SUBNET = "10.77.{n}.{host}"


@dataclass
class Host:
    name: str  # hostname inside the namespace (and its /etc/hosts entry)
    netns: str | None  # None: plain loopback process on this machine
    address: str

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd`` run as this host: inside its namespace, with its own hostname."""
        if self.netns is None:
            return cmd
        inner = " ".join(_quote(c) for c in cmd)
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c",
                f"hostname {self.name} && exec {inner}"]


def _quote(text: str) -> str:
    import shlex

    return shlex.quote(text)


def can_make_namespaces() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("unshare") is not None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def two_hosts() -> Iterator[tuple[Host, Host]]:
    """Two hosts joined by a private link; torn down afterwards whatever happens."""
    if not can_make_namespaces():
        yield Host("127.0.0.1", None, "127.0.0.1"), Host("127.0.0.1", None, "127.0.0.1")
        return
    tag = uuid.uuid4().hex[:6]
    subnet = int(tag[:2], 16) % 200 + 20
    names = [f"hftk{tag}a", f"hftk{tag}b"]
    hosts = [Host(f"node{tag}a", names[0], SUBNET.format(n=subnet, host=1)),
             Host(f"node{tag}b", names[1], SUBNET.format(n=subnet, host=2))]
    veths = [f"hv{tag}a", f"hv{tag}b"]
    etc = [Path("/etc/netns") / n for n in names]
    try:
        for name in names:
            _ip("netns", "add", name)
        _ip("link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
        hosts_text = "127.0.0.1 localhost\n" + "".join(f"{h.address} {h.name}\n" for h in hosts)
        for host, veth, folder in zip(hosts, veths, etc):
            _ip("link", "set", veth, "netns", host.netns)
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", veth)
            _ip("-n", host.netns, "link", "set", "lo", "up")
            _ip("-n", host.netns, "link", "set", veth, "up")
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(hosts_text)
        yield hosts[0], hosts[1]
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        for folder in etc:
            shutil.rmtree(folder, ignore_errors=True)


def node_command(host: Host, main: Host, node_rank: int, nnodes: int, nproc: int, port: int,
                 script: Path, args: list[str], extra: list[str] | None = None) -> list[str]:
    """torchrun for one node of a multi-node job (static rendezvous at ``main``)."""
    require_ranks(nnodes * nproc)  # the "nodes" share this host's devices
    return host.wrap(torchrun_command(nproc, *(extra or []), str(script), *args, nnodes=nnodes, rendezvous=[
        f"--node_rank={node_rank}", f"--master_addr={main.name if main.netns else main.address}", f"--master_port={port}"]))


def run_on_two_hosts(script: Path, args: list[str], nproc: int, timeout: float = 420) -> list[str]:
    """A 2-node job, ``nproc`` ranks per node: one torchrun per host, both at once; their outputs.

    Fails with the output's tail when either node fails; kills both process groups on a timeout.
    """
    with two_hosts() as (a, b):
        port = free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        procs = [subprocess.Popen(node_command(host, a, rank, 2, nproc, port, script, args), env=env, cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
                 for rank, host in enumerate((a, b))]
        try:
            outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, 9)
        for proc, text in zip(procs, outputs):
            assert proc.returncode == 0, text[-5000:]
    return outputs
