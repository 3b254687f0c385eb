"""Limits that hold for a sandbox as a whole: the memory, the number and the CPU time of all its
processes together (``conveyor/sandbox.py`` runs every program under one ``RunLimits``).

- ``pick(name="auto") -> Backend``: ``cgroup2``, ``cgroup1`` or ``supervisor`` (always there),
  chosen once per process and name; an unavailable cgroup backend raises ``LimitsUnavailable``
  saying why, an unknown name ``ValueError`` naming the choices.
- ``RunLimits(backend, Totals(...), launcher)``: one run's limits; ``exceeded()`` says which was
  passed, ``kill()`` and ``close()`` end and remove the run's cgroups.
- cgroups enforce memory and processes in the kernel; the supervisor polls, so a run can
  overshoot by what its processes do within one ``POLL_S`` (``RunLimits`` says what each limit
  means per backend).
"""
from __future__ import annotations

import functools
import logging
import os
import secrets
import signal
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Iterator

log = logging.getLogger(__name__)

POLL_S = 0.1            # how often a run's usage is read
CPU_GRACE_S = POLL_S    # the run's CPU total may pass cpu_s by this much before it is killed
BACKENDS = ("auto", "cgroup2", "cgroup1", "supervisor")
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")
_SETTLE_S = 5.0         # bound on waiting for a run's cgroups to empty before they are removed
# /bin/sh joins each cgroup named before "--", then becomes the command
_JOIN = ('while [ "$1" != -- ]; do echo $$ > "$1" || { echo "sandbox: cannot join the cgroup $1" >&2; exit 125; }; '
         'shift; done; shift; exec "$@"')


class LimitsUnavailable(RuntimeError):
    """The named limits backend cannot work on this machine."""


@dataclass(frozen=True)
class Totals:
    """Of all a sandbox's processes together: what they may use, or (the supervisor's reading) use."""
    memory_bytes: int
    tasks: int       # processes and threads, the sandbox's own (bubblewrap, its init) left out
    cpu_s: float


@dataclass(frozen=True)
class Backend:
    """Where a run's cgroups are made: the parent folder per controller (None: the supervisor's)."""
    name: str
    memory: str | None = None
    pids: str | None = None
    cpu: str | None = None

    def describe(self) -> str:
        if self.name == "supervisor":
            return f"supervisor (the process tree read every {POLL_S:g} s)"
        parts = [f"{what} at {where}" for what, where in
                 (("memory", self.memory), ("pids", self.pids), ("cpu", self.cpu)) if where]
        return f"{self.name} ({'; '.join(parts)})"


# ---------------------------------------------------------------- choosing a backend

@functools.cache
def pick(name: str = "auto") -> Backend:
    """``pick(name="auto") -> Backend``: the backend for this machine, chosen once per process and
    name. ``auto`` takes the first that works of ``cgroup2`` (a delegated, writable cgroup v2
    subtree whose children get the memory controller, and pids if there), ``cgroup1`` (a writable
    cgroup v1 memory hierarchy at our own cgroup; pids and cpuacct where they are writable too) and
    ``supervisor`` (always there). Naming an unavailable cgroup backend raises ``LimitsUnavailable``
    saying why; an unknown name raises ``ValueError`` naming the choices.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown sandbox limits backend {name!r}: use one of {', '.join(BACKENDS)}")
    if name == "supervisor":
        return Backend("supervisor")
    why = []
    for kind, find in (("cgroup2", _find_cgroup2), ("cgroup1", _find_cgroup1)):
        if name in ("auto", kind):
            try:
                return find()
            except LimitsUnavailable as e:
                why.append(str(e))
    if name == "auto":
        log.info("sandbox limits: no writable cgroup (%s); the supervisor polls the process tree", "; ".join(why))
        return Backend("supervisor")
    raise LimitsUnavailable(why[0])


def _mounts() -> Iterator[tuple[str, str, str, set[str]]]:
    """(root, mount point, fs type, super options) of every mount (/proc/self/mountinfo)."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) >= 5 and len(tail) >= 3:
                yield fields[3], fields[4], tail[0], set(tail[2].split(","))


def _own_cgroups() -> dict[str, str]:
    """Controller (``""`` for cgroup v2) -> this process's cgroup path."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    return out


def _folder(mount_root: str, mount_point: str, path: str) -> str | None:
    if path != mount_root and not path.startswith(mount_root.rstrip("/") + "/"):
        return None  # our cgroup is outside what this mount shows
    folder = os.path.normpath(os.path.join(mount_point, path[len(mount_root):].lstrip("/")))
    return folder if os.path.isdir(folder) else None


def _find_cgroup2() -> Backend:
    own = _own_cgroups().get("")
    mounts = [(r, m) for r, m, fs, _ in _mounts() if fs == "cgroup2"]
    if own is None or not mounts:
        raise LimitsUnavailable("cgroup2: no cgroup v2 hierarchy is mounted")
    root, point = mounts[0]
    here = _folder(root, point, own)
    if here is None:
        raise LimitsUnavailable(f"cgroup2: our cgroup {own} is not under {point}")
    why = ""
    # a delegated subtree: our own cgroup, or its parent (never above what the mount shows)
    for parent in [here] + ([os.path.dirname(here)] if here != os.path.normpath(point) else []):
        try:
            controllers = _trial(parent, "cgroup.controllers").split()
        except OSError as e:
            why = f"cannot make a cgroup under {parent} ({e.strerror})"
            continue
        if "memory" in controllers:
            return Backend("cgroup2", memory=parent, pids=parent if "pids" in controllers else None, cpu=parent)
        why = f"the memory controller is not delegated to {parent} (cgroup.subtree_control)"
    raise LimitsUnavailable(f"cgroup2: {why}")


def _find_cgroup1() -> Backend:
    own, found, why = _own_cgroups(), {}, {}
    for root, point, fs, opts in _mounts():
        for c in ("memory", "pids", "cpuacct"):
            if fs != "cgroup" or c not in opts or c not in own or c in found:
                continue
            folder = _folder(root, point, own[c])
            if folder is None:
                why[c] = f"our {c} cgroup {own[c]} is not under {point}"
                continue
            try:
                _trial(folder, "cgroup.procs")
                found[c] = folder
            except OSError as e:
                why[c] = f"cannot make a cgroup under {folder} ({e.strerror})"
    if "memory" not in found:
        raise LimitsUnavailable("cgroup1: " + why.get("memory", "no cgroup v1 memory hierarchy is mounted"))
    return Backend("cgroup1", memory=found["memory"], pids=found.get("pids"), cpu=found.get("cpuacct"))


def _trial(parent: str, read: str) -> str:
    """Make a child cgroup of ``parent``, read one of its files, remove it (OSError: not ours)."""
    path = os.path.join(parent, f"conveyor-probe-{os.getpid()}-{secrets.token_hex(4)}")
    os.mkdir(path)
    try:
        with open(os.path.join(path, read)) as f:
            return f.read()
    finally:
        os.rmdir(path)


# ---------------------------------------------------------------- one run

class RunLimits:
    """One sandbox run's whole-sandbox limits.

    - ``RunLimits(backend, Totals(memory_bytes, tasks, cpu_s), launcher)``: one run's limits.
      ``argv(cmd)`` wraps the command so it joins the run's cgroups before it starts (a ``/bin/sh``
      that writes its pid to each ``cgroup.procs``, then execs the command); ``watch(pid, init_pid)``
      names the process started and, sandboxed, the pid namespace's init; ``exceeded()`` (call it
      every ``POLL_S``) is ``"memory"``, ``"processes"``, ``"cpu_time"`` or None; ``oom_killed()``
      after the end says whether the kernel killed a process of the run for memory; ``kill()`` kills
      every process of the run's cgroups; ``close()`` removes them (a leftover is logged, never
      raised). ``launcher`` is how many processes of the chain above the program belong to the
      sandbox itself (bubblewrap and its init: 2; unsafe: 0): the process limit leaves them out.
    - What each limit means, per backend:
      - memory: cgroups: ``memory.max`` / ``memory.limit_in_bytes`` (swap off where it can be set),
        enforced by the kernel at every allocation; its OOM kill ends the whole run as ``memory``.
        supervisor: the sum of PSS (else RSS) of every process of the sandbox, read every ``POLL_S``;
        above the limit the run is killed as ``memory``.
      - processes: cgroups with pids: ``pids.max`` = tasks + the launcher's, a fork past it fails
        (EAGAIN) and the program goes on. Otherwise the supervisor counts tasks (threads included)
        and kills the run as ``processes`` when there are more.
      - cpu time: the run's total CPU (``cpu.stat`` / ``cpuacct.usage``, else the sum over the tree
        of each process's own and its reaped children's time) past ``cpu_s + CPU_GRACE_S`` kills the
        run as ``cpu_time``; the grace lets a single process meet its own ``RLIMIT_CPU`` first.

    Not guaranteed: the supervisor and the CPU total are polled, so a run can overshoot by what its
    processes do within one ``POLL_S``; a supervised process that leaves the tree (unsafe mode: one
    that daemonises) is not counted.
    """

    def __init__(self, backend: Backend, totals: Totals, launcher: int):
        self.backend, self.totals, self.launcher = backend, totals, launcher
        self.folders: dict[str, str] = {}  # parent -> the run's own cgroup there
        self._tree: _Tree | None = None
        try:
            for parent in dict.fromkeys(p for p in (backend.memory, backend.pids, backend.cpu) if p):
                self.folders[parent] = path = os.path.join(parent, f"conveyor-sandbox-{secrets.token_hex(6)}")
                os.mkdir(path)
            self._write_limits()
        except OSError as e:
            self.close()
            raise LimitsUnavailable(f"sandbox limits: cannot set up the run's cgroup ({e}); "
                                    "pass PythonSandbox(limits_backend='supervisor') to poll the process tree instead") from None

    def _write_limits(self) -> None:
        b, t = self.backend, self.totals
        if b.name == "cgroup2":
            memory, pids = self.folders[b.memory], b.pids and self.folders[b.pids]
            _write(memory, "memory.max", t.memory_bytes)
            _write(memory, "memory.swap.max", 0, optional=True)
            _write(memory, "memory.oom.group", 1, optional=True)  # the kernel kills the whole run
            if pids:
                _write(pids, "pids.max", t.tasks + self.launcher)
        elif b.name == "cgroup1":
            memory = self.folders[b.memory]
            _write(memory, "memory.limit_in_bytes", t.memory_bytes)
            _write(memory, "memory.memsw.limit_in_bytes", t.memory_bytes, optional=True)
            if b.pids:
                _write(self.folders[b.pids], "pids.max", t.tasks + self.launcher)

    def argv(self, cmd: list[str]) -> list[str]:
        if not self.folders:
            return cmd
        procs = [os.path.join(f, "cgroup.procs") for f in self.folders.values()]
        return ["/bin/sh", "-c", _JOIN, "sh", *procs, "--", *cmd]

    def watch(self, pid: int, init_pid: int | None) -> None:
        if self.backend.memory is None or self.backend.pids is None or self.backend.cpu is None:
            self._tree = _Tree(pid, init_pid, count_top=self.launcher == 0)

    def exceeded(self) -> str | None:
        b, t = self.backend, self.totals
        usage = self._tree.usage() if self._tree is not None else None
        if (self.oom_killed() if b.memory else usage is not None and usage.memory_bytes > t.memory_bytes):
            return "memory"
        if b.pids is None and usage is not None and usage.tasks > t.tasks:
            return "processes"
        cpu = self._cgroup_cpu_s() if b.cpu else (usage.cpu_s if usage is not None else 0.0)
        return "cpu_time" if cpu > t.cpu_s + CPU_GRACE_S else None

    def oom_killed(self) -> bool:
        if not self.backend.memory:
            return False
        folder = self.folders[self.backend.memory]
        if self.backend.name == "cgroup2":
            events = _keyed(folder, "memory.events")
            return events.get("oom_kill", 0) + events.get("oom_group_kill", 0) > 0
        return _keyed(folder, "memory.oom_control").get("oom_kill", 0) > 0

    def _cgroup_cpu_s(self) -> float:
        folder = self.folders[self.backend.cpu]
        if self.backend.name == "cgroup2":
            return _keyed(folder, "cpu.stat").get("usage_usec", 0) / 1e6
        return _read_int(folder, "cpuacct.usage") / 1e9

    def members(self) -> set[int]:
        pids: set[int] = set()
        for folder in self.folders.values():
            try:
                with open(os.path.join(folder, "cgroup.procs")) as f:
                    pids.update(int(p) for p in f.read().split())
            except OSError:
                pass  # already removed
        return pids

    def kill(self) -> None:
        """SIGKILL every process of the run's cgroups (the tree's, for the supervisor)."""
        for folder in self.folders.values():
            if self.backend.name == "cgroup2" and os.path.exists(os.path.join(folder, "cgroup.kill")):
                _write(folder, "cgroup.kill", 1, optional=True)
        targets = self.members() | (self._tree.pids() if self._tree is not None else set())
        for pid in targets:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass  # gone meanwhile

    def close(self) -> None:
        """Remove the run's cgroups once they are empty (bounded; a leftover is logged)."""
        give_up = time.monotonic() + _SETTLE_S
        while self.members() and time.monotonic() < give_up:
            self.kill()
            time.sleep(0.01)
        for folder in self.folders.values():
            try:
                os.rmdir(folder)
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("sandbox limits: could not remove the cgroup %s (%s)", folder, e.strerror)
        self.folders = {}


def _write(folder: str, name: str, value: int, optional: bool = False) -> None:
    try:
        with open(os.path.join(folder, name), "w") as f:
            f.write(str(value))
    except OSError:
        if not optional:
            raise


def _read_int(folder: str, name: str) -> int:
    try:
        with open(os.path.join(folder, name)) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _keyed(folder: str, name: str) -> dict[str, int]:
    """A cgroup file of ``key value`` lines."""
    try:
        with open(os.path.join(folder, name)) as f:
            pairs = (line.split() for line in f)
            return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].isdigit()}
    except OSError:
        return {}


# ---------------------------------------------------------------- the supervisor's view of the tree

@dataclass(frozen=True)
class _Proc:
    proc_dir: str     # where its files are read: /proc/N, or /proc/INIT/root/proc/N
    pid: int          # as the host sees it (0 when read through the sandbox's own /proc)
    ppid: int
    threads: int
    own_cpu: int      # clock ticks: utime + stime
    child_cpu: int    # clock ticks of its reaped children: cutime + cstime
    rss_pages: int
    start: int        # clock ticks after boot
    launcher: bool = False  # the sandbox's init: its memory and its reaped orphans' CPU count, not itself


def _stat(proc_dir: str, pid: int = 0) -> _Proc | None:
    try:
        with open(f"{proc_dir}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except OSError:
        return None  # gone meanwhile
    f = raw[raw.rfind(")") + 2:].split()  # the name may hold spaces and parentheses
    return _Proc(proc_dir, pid, int(f[1]), int(f[17]), int(f[11]) + int(f[12]), int(f[13]) + int(f[14]),
                 int(f[21]), int(f[19]))


def _memory(p: _Proc) -> int:
    try:
        with open(f"{p.proc_dir}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass  # not readable here: the resident set instead (shared pages then count in each)
    return p.rss_pages * _PAGE


class _Tree:
    """The processes of one sandbox, read from /proc: through the sandbox's own /proc once its
    pid namespace has mounted one (it lists only the sandbox's processes), else by walking the
    host's /proc down from the process started."""

    def __init__(self, pid: int, init_pid: int | None, count_top: bool):
        self.pid, self.init_pid, self.count_top = pid, init_pid, count_top
        init = _stat(f"/proc/{init_pid}", init_pid) if init_pid else None
        self.init_start = init.start if init else None

    def usage(self) -> Totals:
        procs = self._inside()
        procs = self._host_tree() if procs is None else procs
        ticks = sum(p.child_cpu + (0 if p.launcher else p.own_cpu) for p in procs)
        return Totals(sum(_memory(p) for p in procs), sum(p.threads for p in procs if not p.launcher),
                     ticks / _CLK_TCK)

    def pids(self) -> set[int]:
        return {p.pid for p in self._host_tree()}

    def _inside(self) -> list[_Proc] | None:
        if self.init_start is None:
            return None
        base = f"/proc/{self.init_pid}/root/proc"
        try:
            names = [n for n in os.listdir(base) if n.isdigit()]
        except OSError:
            return None
        procs = {n: p for n in names if (p := _stat(f"{base}/{n}")) is not None}
        if "1" not in procs or procs["1"].start != self.init_start:
            return None  # not (yet, or no longer) the sandbox's own /proc
        procs["1"] = replace(procs["1"], launcher=True)
        return list(procs.values())

    def _host_tree(self) -> list[_Proc]:
        children: dict[int, list[_Proc]] = defaultdict(list)
        for name in os.listdir("/proc"):
            if name.isdigit() and (p := _stat(f"/proc/{name}", int(name))) is not None:
                children[p.ppid].append(replace(p, launcher=p.pid == self.init_pid))
        # sandboxed, the process started is bubblewrap, outside the sandbox: only its descendants count
        top = _stat(f"/proc/{self.pid}", self.pid) if self.count_top else None
        out, todo = [], [top] if top else list(children.get(self.pid, []))
        while todo:
            p = todo.pop()
            out.append(p)
            todo += children.get(p.pid, [])
        return out
