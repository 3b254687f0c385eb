"""The RPC wire format: tensors travel as raw bytes and come back equal, whatever their dtype or layout."""
import multiprocessing as mp
from pathlib import Path

import torch

from conveyor.runtime.procs import dumps, loads
from conveyor.types import Batch


def test_tensors_round_trip_exactly():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    cases = {
        "bf16": torch.randn(5, 3).to(torch.bfloat16),
        "int64": torch.tensor([1, -2, 2**40]),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 7),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "transposed view": base.t(),
        "slice": base[1:, ::2],
    }
    back = loads(dumps(cases))
    for name, t in cases.items():
        assert back[name].dtype == t.dtype, name
        assert back[name].shape == t.shape, name
        assert torch.equal(back[name], t), name
    back["slice"][0, 0] = -1.0  # a copy, not a view of the sender's storage
    assert base[1, 0] == 4.0


def test_batch_and_grad_tensors():
    ids = [torch.arange(n) for n in (3, 1, 5)]
    batch = Batch(input_ids=ids, loss_mask=[torch.ones(n) for n in (3, 1, 5)],
                  fields={"advantages": [torch.full((n,), 0.5) for n in (3, 1, 5)]})
    back = loads(dumps(("train", (batch,), {})))
    assert back[0] == "train"
    got = back[1][0]
    assert [x.tolist() for x in got.input_ids] == [x.tolist() for x in ids]
    assert got.fields["advantages"][2].tolist() == [0.5] * 5
    w = torch.ones(2, requires_grad=True)  # not raw bytes: the default reduction keeps requires_grad
    assert loads(dumps(w)).requires_grad


def _echo(conn):
    conn.send_bytes(dumps(loads(conn.recv_bytes())))


def test_across_a_process_pipe(monkeypatch):
    # The spawned child imports this module by name: put the repository root on the path it
    # inherits, whichever way pytest was started (the `pytest` script does not add it).
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[3]))
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_echo, args=(b,))
    p.start()
    t = torch.randn(4, 4).to(torch.bfloat16)
    a.send_bytes(dumps({"t": t}))
    assert a.poll(60)
    assert torch.equal(loads(a.recv_bytes())["t"], t)
    p.join(30)
    assert p.exitcode == 0


def _mark(path: str, what: str) -> None:
    Path(path).with_suffix("." + what).write_text(what)


def _serve_marker(path: str) -> None:
    _mark(path, "served")


def _prepare_marker(path: str) -> None:
    _mark(path, "prepared")


def _wait_for(cond, what: str, timeout: float = 120.0) -> None:
    import time
    deadline = time.monotonic() + timeout  # a "no hang" bound: a spawn takes seconds
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_standby_prepares_then_waits_and_runs_only_once_it_takes_over(tmp_path, monkeypatch):
    from conveyor.runtime.procs import RoleProcess
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[3]))
    ctx = mp.get_context("spawn")
    marker = str(tmp_path / "marker")
    proc = RoleProcess("engine7", _serve_marker, (marker,), tmp_path / "logs", ctx, prepare=_prepare_marker)
    standby_log = tmp_path / "logs" / "engine7.standby.log"
    assert proc.log_path == standby_log
    _wait_for(lambda: standby_log.exists() and "standby ready" in standby_log.read_text(), "the standby prepared")
    assert Path(marker + ".prepared").exists() and not Path(marker + ".served").exists()  # it waits
    role_log = tmp_path / "logs" / "engine7.log"
    assert not role_log.exists()  # its log says nothing until it is the role
    proc.take_over()
    _wait_for(lambda: Path(marker + ".served").exists(), "the standby ran its target after take_over")
    proc.proc.join(60)
    assert proc.proc.exitcode == 0 and proc.log_path == role_log
    text = role_log.read_text()
    assert "[engine7] taking over from its standby process" in text and "[engine7] started pid=" in text
    assert "started pid=" not in standby_log.read_text()


def test_a_standby_never_needed_is_stopped_without_running(tmp_path, monkeypatch):
    from conveyor.runtime.procs import RoleProcess
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[3]))
    marker = str(tmp_path / "marker")
    proc = RoleProcess("engine0", _serve_marker, (marker,), tmp_path / "logs", mp.get_context("spawn"),
                       prepare=_prepare_marker)
    _wait_for(lambda: Path(marker + ".prepared").exists(), "the standby prepared")
    proc.stop(timeout=0)
    assert not proc.proc.is_alive() and not Path(marker + ".served").exists()
