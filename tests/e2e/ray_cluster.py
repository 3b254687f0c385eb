"""A real two-node Ray cluster on loopback for tests: started with `ray start`, stopped by pid.

``RayCluster.start(root)`` starts a head node (custom resource ``node_a``) and
a second node (``node_b``) with their own temp dirs under ``root``, small CPU
counts, no dashboard and a 200 MB object store each. ``stop()`` ends every
process of this cluster — those whose command line names its temp dirs or its
GCS port, and their descendants — by pid (no `ray stop`, which would stop
every Ray instance of the machine) and returns the pids still alive (none).
Ray 2.60 on loopback needs ``RAY_AUTH_MODE`` (``auth``: token, or disabled)
in the head's, the node's and the driver's environment: ``env`` is that
environment. Ray reads it when first imported, so a driver that imported Ray
before setting it runs as "disabled" (the default).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RayCluster:
    root: Path
    port: int
    env: dict

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @classmethod
    def start(cls, root: Path, cpus: int = 3, auth: str = "token") -> RayCluster:
        # The repository root on the workers' path: tests load their rewards there by module name.
        path = os.pathsep.join(p for p in (str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "RAY_AUTH_MODE": auth, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": path}
        c = cls(root, _free_port(), env)
        common = [f"--num-cpus={cpus}", "--object-store-memory=200000000", "--node-ip-address=127.0.0.1",
                  "--disable-usage-stats"]
        try:
            c._ray("start", "--head", f"--port={c.port}", "--include-dashboard=false",
                   f"--temp-dir={root / 'a'}", "--resources={\"node_a\": 1}", *common)
            c._ray("start", f"--address={c.address}", f"--temp-dir={root / 'b'}",
                   "--resources={\"node_b\": 1}", *common)
        except BaseException:
            c.stop()
            raise
        return c

    def _ray(self, *args: str) -> None:
        r = subprocess.run([RAY, *args], check=False, env=self.env, capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"ray {' '.join(args)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")

    def processes(self) -> set[int]:
        """Pids of this cluster's processes and their descendants (read from /proc)."""
        marks = (str(self.root), f":{self.port}")
        table = _table()
        found = {pid for pid, (_, cmd) in table.items() if pid != os.getpid() and any(m in cmd for m in marks)}
        todo = list(found)
        while todo:
            parent = todo.pop()
            for pid, (ppid, _) in table.items():
                if ppid == parent and pid not in found:
                    found.add(pid)
                    todo.append(pid)
        return found

    def stop(self, grace_s: float = 10.0) -> set[int]:
        pids = self.processes()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and any(_alive(p) for p in pids):
                time.sleep(0.1)
            pids = {p for p in pids if _alive(p)}
            if not pids:
                break
        time.sleep(0.5)
        return {p for p in self.processes() if _alive(p)}


def wait_first_step(proc: subprocess.Popen, run: Path, deadline_s: float = 600.0) -> None:
    """Wait until the run in ``run`` has logged a step; fail with its stderr if it ended first."""
    deadline = time.monotonic() + deadline_s
    while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run did not reach its first step"
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    """Running (a zombie counts as gone: its parent, not us, reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        out[int(d.name)] = (ppid, cmd)
    return out
