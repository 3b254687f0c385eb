"""Run untrusted Python in a bubblewrap sandbox: the model's code for the ``python`` tool
(``env/tools/sandbox.py``) and generated programs under test for the ``code`` reward.

- ``PythonSandbox(limits).run(code, stdin="") -> SandboxResult`` never raises for the program's
  sake: a breach of ``SandboxLimits`` is the result's ``violation``.
- Sandboxed: new pid, net, ipc, uts and cgroup namespaces, read-only system and interpreter
  paths, a private /tmp and no other host path; rlimits per process and limits on the sandbox
  as a whole (``limits_backend``, ``conveyor/sandbox_limits.py``). When ``run`` returns, every
  process of the sandbox is gone. ``PythonSandbox`` states each guarantee and what is not
  guaranteed; tests/unit/env/test_sandbox.py tries each escape.
- As root, the code runs under a uid drawn per run, not bwrap's ``--unshare-user --uid`` (root's
  user namespace maps that back to host uid 0, which RLIMIT_NPROC exempts).
- No usable ``bwrap``: ``SandboxUnavailable`` naming the package. ``unsafe=True`` isolates nothing.
- Not a VM: the kernel is shared, and there is no seccomp filter.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import select
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass

from conveyor.sandbox_limits import POLL_S, LimitsUnavailable, RunLimits, Totals, pick


log = logging.getLogger(__name__)

_UNSAFE_HINT = "or pass PythonSandbox(unsafe=True) (env.kwargs.unsafe_python: true) to run model code UNSANDBOXED"
_SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_SYSTEM_FILES = ("/etc/alternatives", "/etc/ld.so.cache")
_UID_RANGE = (1 << 30, 1 << 31)  # above login uids and the sub-uid ranges containers use
_TEARDOWN_S = 10.0  # bound on waiting for the kernel to empty the pid namespace
_PROBED: set[tuple] = set()
_REPORTED: set[str] = set()
_LAUNCHER = 2  # bubblewrap and its init: the sandbox's own processes, beside the program's


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run on this machine (bubblewrap missing or failing)."""


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 5            # CPU seconds of all the processes together (and RLIMIT_CPU of each)
    memory_mb: int = 512      # memory of all the processes together (and RLIMIT_AS of each)
    processes: int = 32       # processes and threads at once (RLIMIT_NPROC; pids.max)
    open_files: int = 64      # RLIMIT_NOFILE
    output_bytes: int = 65536  # stdout + stderr kept
    tmp_mb: int = 64          # size of the private tmpfs at /tmp
    wall_s: float = 10.0      # wall-clock deadline of one run


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    truncated: bool
    violation: str | None
    wall_s: float


class PythonSandbox:
    """A bubblewrap sandbox for one program per ``run``, under ``SandboxLimits``.

    Contract
    - ``PythonSandbox(limits).run(code, stdin="") -> SandboxResult``: ``code`` runs as
      ``python -B /tmp/main.py`` (copied in through a memfd, never on a command line) with
      ``stdin``. stdout + stderr keep at most ``output_bytes`` (past that the program is stopped,
      a marker ends the text, ``truncated``); ``exit_code`` is ``-N`` for death by signal N (as
      in subprocess), None when stopped; ``violation``: None, ``timeout`` (wall), ``cpu_time``
      (SIGXCPU of one process, or the whole sandbox's CPU total), ``memory`` (a MemoryError, or
      the whole sandbox's memory), ``processes`` (the supervisor counted more), ``output``,
      ``killed_by_signal N``. ``run`` never raises for the program's sake.
    - ``limits_backend`` (``auto``, ``cgroup2``, ``cgroup1``, ``supervisor``; chosen at
      construction, the one in use is ``PythonSandbox.limits_backend`` and logged once): how the
      memory, processes and CPU seconds of ``SandboxLimits`` hold for all of the sandbox's
      processes together (``conveyor/sandbox_limits.py``; each process also keeps its own
      RLIMIT_AS, RLIMIT_NPROC, RLIMIT_CPU). A named cgroup backend this machine lacks:
      ``SandboxUnavailable`` saying why.
    - No ``bwrap`` (>= 0.8, for ``--size``), or one failing a trial run: ``SandboxUnavailable``
      naming the package. ``unsafe=True``: a plain subprocess with rlimits, the whole-sandbox
      limits and the deadline, and a warning on every construction.

    Guarantees (sandboxed; tests/unit/env/test_sandbox.py tries each escape)
    - New pid, net, ipc, uts, cgroup namespaces: no network (a private loopback), no view of
      or signal to host processes.
    - Read-only: /usr (and the /bin, /lib* links), /etc/alternatives, /etc/ld.so.cache, the
      interpreter's prefixes (venv and base). Fresh /proc, /dev; /tmp a private tmpfs of
      ``tmp_mb``. No other host path: no /etc/shadow, home, run directory or cwd.
    - As root, the code runs under a uid drawn per run (no capabilities, no_new_privs).
      ``bwrap --unshare-user --uid`` is not used: root's user namespace maps that uid back to
      host uid 0, which the kernel exempts from RLIMIT_NPROC (a fork bomb went unchecked). One
      uid per run, as RLIMIT_NPROC counts a uid's processes host-wide. Non-root callers get
      bwrap's user namespace, where the count is per namespace.
    - rlimits per process: CPU seconds, address space, processes, open files, no core files.
    - Memory, processes and CPU seconds of the sandbox as a whole, by backend:
      cgroup2 / cgroup1: the kernel's memory limit (swap off where it can be set; files in /tmp
      count), exact, its OOM kill ends the run as ``memory``; pids.max where that controller is
      there (a fork past it fails); CPU total read every ``POLL_S``. supervisor: PSS of the
      sandbox's processes, their tasks and CPU time read from its own /proc every ``POLL_S``.
    - When ``run`` returns, every process of the sandbox is gone, daemonised or not (its pid
      namespace is torn down; at the deadline its pid 1 is killed).

    Not guaranteed
    - Not a VM: the kernel is shared, a kernel bug is an escape. No seccomp filter: the code
      may use any syscall and create nested user namespaces (more kernel attack surface).
    - The supervisor polls: a sandbox overshoots by what its processes touch in one ``POLL_S``
      (measured on a 2-core EPYC: up to 153 MB over 512 MB, at about 0.9 GB/s of first touches a
      core), never beyond ``processes`` x ``memory_mb`` (RLIMIT_AS of each); /tmp files are not
      counted (``tmp_mb`` caps them). The CPU total may pass ``cpu_s`` by ``CPU_GRACE_S`` plus
      one poll.
    - ``sys.exit(128 + N)`` reads as death by signal N (bwrap reports both alike); ``memory`` is
      read from the last line of stderr.
    - ``unsafe=True`` isolates nothing: host files, network and processes are open to the code,
      RLIMIT_NPROC binds no root, no tmpfs cap, a child leaving the process group outlives it
      (on cgroups it is killed when the run ends; the supervisor loses sight of it).
    """
    def __init__(self, limits: SandboxLimits = SandboxLimits(), python: str = sys.executable,
                 unsafe: bool = False, bwrap: str = "bwrap", limits_backend: str = "auto"):
        self.limits, self.unsafe = limits, unsafe
        self.python = os.path.abspath(shutil.which(python) or python)
        try:
            self._backend = pick(limits_backend)
        except LimitsUnavailable as e:
            raise SandboxUnavailable(f"{e}; use limits_backend='auto' to take what this machine has") from None
        self.limits_backend = self._backend.name  # cgroup2, cgroup1 or supervisor: see sandbox_limits.py
        if self._backend.describe() not in _REPORTED:
            _REPORTED.add(self._backend.describe())
            log.info("sandbox limits (memory, processes, CPU time of the whole sandbox): %s", self._backend.describe())
        if unsafe:
            msg = ("PythonSandbox(unsafe=True): model code runs UNSANDBOXED as a plain subprocess "
                   "(rlimits, the whole-sandbox limits and a deadline only; host files, network and processes "
                   "are reachable)")
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            log.warning(msg)
            return
        self.bwrap = shutil.which(bwrap)
        if self.bwrap is None:
            raise SandboxUnavailable(f"bubblewrap ({bwrap!r}) not found: install it (Debian/Ubuntu: "
                                     f"apt-get install bubblewrap) {_UNSAFE_HINT}")
        self.prlimit, self.setpriv = (shutil.which(t, path="/usr/bin:/bin") for t in ("prlimit", "setpriv"))
        if not (self.prlimit and self.setpriv):
            raise SandboxUnavailable(f"prlimit/setpriv not found in /usr/bin: install util-linux {_UNSAFE_HINT}")
        self.binds = _bind_args(self.python)
        key = (self.bwrap, self.python, os.geteuid(), limits, self._backend)
        if key not in _PROBED:  # a bwrap that can't make namespaces fails here, not in every tool call
            r = self.run("print('ok')")
            if r.stdout != "ok\n":
                raise SandboxUnavailable(f"bubblewrap failed a trial run (exit {r.exit_code}, {r.violation}): "
                                         f"{r.stderr.strip()[-500:]} {_UNSAFE_HINT}")
            _PROBED.add(key)

    def run(self, code: str, stdin: str = "") -> SandboxResult:
        t0, lim = time.monotonic(), self.limits
        try:
            guard = RunLimits(self._backend, Totals(lim.memory_mb << 20, lim.processes, lim.cpu_s),
                              launcher=0 if self.unsafe else _LAUNCHER)
        except LimitsUnavailable as e:
            raise SandboxUnavailable(str(e)) from None
        try:
            if self.unsafe:
                with tempfile.TemporaryDirectory(prefix="conveyor-unsafe-") as tmp:
                    with open(os.path.join(tmp, "main.py"), "w", encoding="utf-8") as f:
                        f.write(code)
                    proc = _popen(guard.argv(self._unsafe_argv()), cwd=tmp, env=_env(tmp, self.python))
                    return self._execute(proc, stdin, t0, guard)
            return self._run_bwrap(code, stdin, t0, guard)
        finally:
            guard.close()  # the run's cgroups, also when this raised

    def _run_bwrap(self, code: str, stdin: str, t0: float, guard: RunLimits) -> SandboxResult:
        info_r, info_w = os.pipe()
        fds = [info_r, info_w]  # each closed exactly once: a number closed twice may be another thread's
        try:
            fds.append(code_fd := os.memfd_create("main.py"))
            data = memoryview(code.encode("utf-8", "surrogatepass"))
            while data:
                data = data[os.write(code_fd, data):]
            os.lseek(code_fd, 0, os.SEEK_SET)
            proc = _popen(guard.argv(self._bwrap_argv(code_fd, info_w)), pass_fds=(code_fd, info_w))
            for fd in (info_w, code_fd):  # only bwrap holds them now: EOF once it has written the pid
                fds.remove(fd)
                os.close(fd)
            return self._execute(proc, stdin, t0, guard, info_r)
        finally:
            for fd in fds:
                os.close(fd)

    def _execute(self, proc: subprocess.Popen, stdin: str, t0: float, guard: RunLimits,
                 info_r: int | None = None) -> SandboxResult:
        deadline, init_fd, out, err, stop = t0 + self.limits.wall_s, None, b"", b"", "crash"
        try:
            init_pid, init_fd = _open_init(info_r, deadline) if info_r is not None else (None, None)
            guard.watch(proc.pid, init_pid)
            mark = f"\n[output cut at {self.limits.output_bytes} bytes: the program was stopped]\n".encode()
            out, err, stop = _pump(proc, stdin.encode("utf-8", "surrogatepass"), deadline,
                                   self.limits.output_bytes, mark, guard.exceeded)
            if stop is None:
                stop = _wait(proc, deadline, guard.exceeded)
        finally:
            if stop is not None:  # also when this raised: nothing of the program outlives ``run``
                _kill_tree(proc, init_fd)
                guard.kill()
            code = proc.wait()
            if init_fd is not None:
                # bwrap exits as soon as its init reports the program's status, before the kernel
                # has torn the pid namespace down; the init ends only once all in it are reaped.
                select.select([init_fd], [], [], _TEARDOWN_S)
                os.close(init_fd)
            proc.stdout.close()
            proc.stderr.close()
        if stop is None and guard.oom_killed():
            stop = "memory"  # the kernel killed a process of the run at the cgroup's limit
        if not self.unsafe and code > 128 and code - 128 < signal.NSIG:
            code = 128 - code  # bwrap reports death by signal N as 128 + N; say -N as subprocess does
        stdout, stderr = (b.decode("utf-8", "replace") for b in (out, err))
        return SandboxResult(stdout, stderr, None if stop else code, stop == "timeout", stop == "output",
                             stop or _violation(code, stderr), time.monotonic() - t0)

    def _bwrap_argv(self, code_fd: int, info_fd: int) -> list[str]:
        lim = self.limits
        if os.geteuid() == 0:  # bwrap's privileged mode, no user namespace: see the module docstring
            ns = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                  "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]  # for setpriv, which drops them
            lo, hi = _uid_range()
            uid = lo + secrets.randbelow(hi - lo)
            drop = [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
        else:
            ns, drop = ["--unshare-all", "--unshare-user", "--disable-userns"], []
        # The private /tmp first: an interpreter that lives under the host's /tmp (a virtual
        # environment made there) is then bound on top of it, not hidden by it.
        return [self.bwrap, *ns, "--die-with-parent", "--new-session",
                "--perms", "1777", "--size", str(lim.tmp_mb << 20), "--tmpfs", "/tmp",
                *self.binds, "--proc", "/proc", "--dev", "/dev",
                "--perms", "0444", "--file", str(code_fd), "/tmp/main.py", "--chdir", "/tmp", "--clearenv",
                *[a for k, v in _env("/tmp", self.python).items() for a in ("--setenv", k, v)],
                "--info-fd", str(info_fd), "--",
                self.prlimit, f"--cpu={lim.cpu_s}:{lim.cpu_s + 1}", f"--as={lim.memory_mb << 20}",
                f"--nproc={lim.processes}", f"--nofile={lim.open_files}",
                "--core=0", "--",  # no core files: core_pattern may hand them to a root helper on the host
                self.setpriv, *drop, "--inh-caps=-all", "--no-new-privs", "--", self.python, "-B", "/tmp/main.py"]

    def _unsafe_argv(self) -> list[str]:
        lim = self.limits
        limits = {"RLIMIT_CPU": (lim.cpu_s, lim.cpu_s + 1), "RLIMIT_AS": (lim.memory_mb << 20,) * 2,
                  "RLIMIT_NPROC": (lim.processes,) * 2, "RLIMIT_NOFILE": (lim.open_files,) * 2, "RLIMIT_CORE": (0, 0)}
        # set by the child itself: preexec_fn may deadlock in a threaded parent (the env pool)
        boot = (f"import resource as r, runpy, sys\nfor k, v in {limits!r}.items(): r.setrlimit(getattr(r, k), v)\n"
                "sys.argv = ['main.py']\nrunpy.run_path('main.py', run_name='__main__')\n")
        return [self.python, "-B", "-c", boot]


@functools.cache
def _uid_range() -> tuple[int, int]:
    # a container's user namespace may map only 65536 ids: then all runs share nobody's budget
    with open("/proc/self/uid_map") as f:
        spans = [tuple(map(int, line.split())) for line in f]
    lo, hi = _UID_RANGE
    return _UID_RANGE if any(a <= lo and hi <= a + n for a, _, n in spans) else (65534, 65535)


def _env(home: str, python: str) -> dict[str, str]:
    return {"PATH": f"{os.path.dirname(python)}:/usr/local/bin:/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1"}  # so what was printed before a deadline kill still reaches the model


def _popen(argv: list[str], **popen) -> subprocess.Popen:
    # a new session: the deadline kills the whole group (in unsafe mode, the program's tree)
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, **popen)


def _feed(f, data: bytes) -> None:
    try:
        f.write(data)
        f.close()
    except OSError:
        pass  # the program stopped reading (or was stopped): the rest is dropped


def _pump(proc: subprocess.Popen, stdin: bytes, deadline: float, cap: int, mark: bytes, check):
    """Read stdout/stderr (at most ``cap`` bytes together) as they come, so a flood costs
    ``cap`` bytes of memory, until both close, the deadline passes, the cap is exceeded or
    ``check()`` (called every ``POLL_S``) names a limit crossed; returns (stdout, stderr, the
    reason it stopped early or None)."""
    if stdin:  # a thread, so a program that doesn't read its stdin can't stall the reading
        threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True).start()
    else:
        proc.stdin.close()  # EOF at once: the host's stdin is never inherited
    sel = selectors.DefaultSelector()
    bufs = {f.fileno(): bytearray() for f in (proc.stdout, proc.stderr)}
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    kept, stop, next_check = 0, None, time.monotonic() + POLL_S
    while sel.get_map() and stop is None:
        now = time.monotonic()
        if now >= next_check:
            stop, next_check = check(), now + POLL_S
            if stop is not None:
                break
        left = deadline - now
        events = sel.select(min(left, next_check - now)) if left > 0 else []
        if not events and time.monotonic() >= deadline:
            stop = "timeout"
        for key, _ in events:
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fd)
                continue
            room = cap - kept
            bufs[key.fd] += chunk[:room]
            kept += min(len(chunk), room)
            if len(chunk) > room:
                bufs[key.fd] += mark
                stop = "output"
                break
    sel.close()
    return bufs[proc.stdout.fileno()], bufs[proc.stderr.fileno()], stop


def _wait(proc: subprocess.Popen, deadline: float, check) -> str | None:
    """Wait for the program's end until the deadline, calling ``check()`` every ``POLL_S``;
    the reason it was stopped, or None."""
    while True:
        try:
            proc.wait(timeout=max(0.0, min(deadline - time.monotonic(), POLL_S)))
            return None
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                return "timeout"
            if (stop := check()) is not None:
                return stop


def _open_init(info_r: int, deadline: float) -> tuple[int | None, int | None]:
    """The pid and a pidfd of the sandbox's pid 1, named by bwrap's --info-fd. bwrap writes it
    right after the clone, while that child still sets the sandbox up, and reaps it only on its
    own way out: the pid is still the sandbox's when it is opened here."""
    info = b""
    while select.select([info_r], [], [], max(0.0, deadline - time.monotonic()))[0]:
        chunk = os.read(info_r, 4096)
        if not chunk:
            break
        info += chunk
    try:
        pid = int(json.loads(info)["child-pid"])
        return pid, os.pidfd_open(pid)
    except (ValueError, KeyError, TypeError, OSError):
        return None, None  # bwrap failed before the clone, or the sandbox is already gone


def _kill_tree(proc: subprocess.Popen, init_fd: int | None) -> None:
    # Killing the sandbox's pid 1 makes the kernel kill every process of its pid namespace,
    # daemonised or not; killing bwrap alone would leave that to --die-with-parent.
    if init_fd is not None:
        try:
            signal.pidfd_send_signal(init_fd, signal.SIGKILL)
        except OSError:
            pass  # already gone
    try:  # bwrap itself, or in unsafe mode the program's process group
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _violation(code: int, stderr: str) -> str | None:
    if code >= 0:
        lines = stderr.strip().splitlines()
        return "memory" if code and lines and lines[-1].startswith("MemoryError") else None
    return "cpu_time" if -code == signal.SIGXCPU else f"killed_by_signal {-code}"


def _bind_args(python: str) -> list[str]:
    """Read-only binds of the system and of the interpreter's prefixes, nothing else."""
    args, made, bound = ["--ro-bind", "/usr", "/usr"], set(), ["/usr", *_SYSTEM_LINKS]
    for p in _SYSTEM_LINKS:  # merged-/usr systems: keep them links, as the dynamic loader expects
        if os.path.islink(p):
            args += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            args += ["--ro-bind", p, p]
    for root in (*[p for p in _SYSTEM_FILES if os.path.exists(p)], *_python_roots(python)):
        if any(root == b or root.startswith(b + "/") for b in bound):
            continue
        cwd = os.getcwd()
        if root in ("/", "/etc", "/root", "/home") or cwd == root or cwd.startswith(root + "/"):
            raise SandboxUnavailable(f"the interpreter's prefix {root} would expose the host ({python}); "
                                     "use a Python installed in its own folder or a virtual environment")
        # bwrap makes a mount point's missing parents 0700 root: the sandbox uid could not reach
        # /root/.pyenv/... (and the interpreter silently loaded the system's libpython instead)
        for d in ("/" + "/".join(root.strip("/").split("/")[:i]) for i in range(1, root.count("/"))):
            if d not in made and d != "/tmp":  # /tmp is the sandbox's own tmpfs (mode 1777)
                made.add(d)
                args += ["--perms", "0755", "--dir", d]
        args += ["--ro-bind", root, root]
        bound.append(root)
    return args


@functools.cache
def _python_roots(python: str) -> tuple[str, ...]:
    probe = "import os, sys; print(sys.prefix); print(sys.base_prefix); print(os.path.realpath(sys.executable))"
    out = subprocess.run([python, "-I", "-c", probe], capture_output=True, text=True, timeout=60, check=True).stdout
    prefix, base, exe = out.splitlines()[:3]
    paths = {prefix, base, os.path.realpath(prefix), os.path.realpath(base)}
    if not any(exe.startswith(p + "/") for p in paths):
        paths.add(exe)
    return tuple(sorted(paths, key=len))  # shortest first: a prefix inside another is then skipped
