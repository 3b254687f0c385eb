"""The test harness that ``reward/code.py`` runs INSIDE the sandbox (standard library only).

- Run as a script (``main``): one JSON object on stdin, one JSON line per test on stdout, as soon
  as it is known, so lines already written survive the sandbox's own deadline.
- Each test runs in a forked child of its own under ``test_timeout_s``; the parent runs no code
  of the program. One letter per test is its verdict.

Not guaranteed: the child runs the harness's code in the same process as the program, so a
program written to attack the harness (writing its own verdict to the result pipe) can forge a
pass; assert-based tests are also fooled by objects whose ``__eq__`` always returns True.
"""
import json
import os
import select
import signal
import sys
import time

_DETAIL = 200


def _verdict(program, test) -> tuple[str, str]:
    try:
        namespace = {"__name__": "solution", "__builtins__": __builtins__}
        exec(program, namespace)
        exec(test, namespace)
    except AssertionError as e:
        return "F", str(e)
    except MemoryError:
        return "M", "MemoryError"
    except BaseException as e:  # noqa: BLE001 - anything the program does is its verdict
        return "E", f"{type(e).__name__}: {e}"
    return "P", ""


def _child(write_fd: int, program, test) -> None:
    os.setpgid(0, 0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    letter, detail = _verdict(program, test)
    os.write(write_fd, json.dumps({"v": letter, "d": detail[:_DETAIL]}).encode())
    os._exit(0)


def _run_one(program, test, timeout_s: float) -> tuple[str, str]:
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()  # the child must not inherit unflushed lines and print them twice
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        try:
            _child(write_fd, program, test)
        finally:
            os._exit(1)
    os.close(write_fd)
    deadline, data, timed_out = time.monotonic() + timeout_s, b"", False
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([read_fd], [], [], left)[0]:
            timed_out = True
            break
        chunk = os.read(read_fd, 4096)
        data += chunk
        # the verdict is one small write; a grandchild still holding the pipe must not delay it
        if not chunk or _parse(data) is not None:
            break
    os.close(read_fd)
    try:
        os.killpg(pid, signal.SIGKILL)  # also the child's own children, done or not
    except OSError:
        pass
    _, status = os.waitpid(pid, 0)
    if timed_out:
        return "T", f"no verdict within {timeout_s:g}s"
    verdict = _parse(data)
    if verdict is not None:
        return verdict
    how = (f"killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
           else f"exit code {os.waitstatus_to_exitcode(status)}")
    return "X", f"ended without a verdict ({how})"


def _parse(data: bytes):
    try:
        out = json.loads(data)
        return str(out["v"]), str(out["d"])
    except (ValueError, KeyError, TypeError):
        return None


def _emit(record: dict) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def main() -> None:
    """Run the tests of the program on stdin, one verdict line each.

    - Run as a script (its source is the sandboxed ``/tmp/main.py``); reads one JSON object from
      stdin: ``{"program": str, "tests": [str, ...], "test_timeout_s": float}``.
    - Compiles the program once: a ``SyntaxError`` makes every test ``S`` and nothing runs.
    - Each test runs in a forked child of its own: the program's top level, then the test snippet,
      in a fresh namespace (``__name__ == "solution"``, so a ``__main__`` block of the program does
      not run), stdin/stdout/stderr on /dev/null, in a process group of its own. The parent runs no
      code of the program; it waits for the child's verdict at most ``test_timeout_s`` and then
      kills the group, so a loop in C code or a child that forks is stopped too.
    - Verdicts (one letter): ``P`` pass, ``F`` fail (``AssertionError``), ``E`` error (any other
      exception, in the program's top level or in the test; ``SystemExit`` included), ``T`` timeout,
      ``M`` memory (``MemoryError``), ``X`` the child ended without a verdict (``os._exit``, killed by
      a signal, a CPU-time limit), ``B`` the test itself does not compile (a bad task, not the
      program's fault), ``S`` the program does not compile.
    - Writes one JSON line per test, as soon as it is known, to stdout:
      ``{"i": index, "v": letter, "d": detail (at most 200 characters)}``, then ``{"done": true}``.
      Lines already written survive the sandbox's own deadline, so the host keeps them.
    """
    job = json.loads(sys.stdin.read())
    tests, timeout_s = job["tests"], float(job["test_timeout_s"])
    try:
        program = compile(job["program"], "solution.py", "exec")
    except (SyntaxError, ValueError) as e:  # ValueError: a NUL byte in the source
        for i in range(len(tests)):
            _emit({"i": i, "v": "S", "d": f"{type(e).__name__}: {e}"[:_DETAIL]})
        _emit({"done": True})
        return
    for i, text in enumerate(tests):
        try:
            test = compile(text, f"test_{i}.py", "exec")
        except (SyntaxError, ValueError) as e:
            _emit({"i": i, "v": "B", "d": f"{type(e).__name__}: {e}"[:_DETAIL]})
            continue
        letter, detail = _run_one(program, test, timeout_s)
        _emit({"i": i, "v": letter, "d": detail[:_DETAIL]})
    _emit({"done": True})


if __name__ == "__main__":
    main()
