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
