"""A run with ``loop.accumulate_groups`` (parts trained as their groups are scored) takes the same
first step as the run that waits for the whole batch, synchronous or streaming; a synchronous one
stays on policy, and the colocated engine's KV pool is released and taken back every step
(``launch.time_share``)."""
import json

import pytest
import torch

from conveyor.cli import main
from conveyor.config import load_config
from conveyor.observe.timeline import read_timeline

RUN = ["sft.steps=30", "loop.steps=2", "loop.batch_size=8", "rollout.n=4", "loop.eval_every=0", "data.eval_size=8",
       "trainer.mini_batches=1", "observe.progress=false", "observe.tensorboard=false"]


def _run(tmp_path, name, *extra):
    out = tmp_path / name
    assert main(["train", *RUN, *extra, f"--output-dir={out}"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out, [r for r in rows if r.get("kind") == "train"]


@pytest.mark.slow  # over 5 s on a 2-core CPU: `pytest -m "not slow"` leaves it out
@pytest.mark.parametrize("runner", ["hf", "fast"])
def test_accumulated_parts_take_the_whole_batchs_step(tmp_path, runner):
    _, whole = _run(tmp_path, "whole", f"rollout.runner={runner}")
    out, parts = _run(tmp_path, "parts", f"rollout.runner={runner}", "loop.accumulate_groups=3",
                      "launch.time_share=on")
    first, again = whole[0], parts[0]
    # The same samples (the engine has the same weights and random streams) ...
    for key in ("reward", "num_tokens", "num_seqs", "response_len"):
        assert again[key] == first[key], key
    # ... and the same gradient, up to float32 summation order over the step's ~1e3 loss tokens.
    eps = torch.finfo(torch.float32).eps
    assert again["loss"] == pytest.approx(first["loss"], abs=1e3 * eps * max(1.0, abs(first["loss"])))
    # On a GPU the trainer computes in bf16, and parts are other GEMM shapes than the whole batch:
    # each gradient element may differ by about one bf16 rounding (2^-8 relative), the norm no more.
    rel = 2 ** -8 if torch.cuda.is_available() else 1e-4
    assert again["grad_norm"] == pytest.approx(first["grad_norm"], rel=rel)
    assert all(r["staleness_max"] == 0 for r in parts)  # max_staleness = 0: every token on policy
    assert all(r["time/release"] > 0 and r["time/reacquire"] > 0 for r in parts)
    spans = read_timeline(out)
    names = {s["name"] for s in spans}
    assert {"accumulate", "release memory", "take memory"} <= names
    assert sum(s["name"] == "accumulate" for s in spans) == 2 * 3  # 8 groups in parts of 3, 3, 2 per step


@pytest.mark.slow  # over 5 s on a 2-core CPU: `pytest -m "not slow"` leaves it out
@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])  # one process, or a trainer process
def test_a_streaming_run_accumulates_the_groups_it_would_have_taken_whole(tmp_path, placement):
    stream = ["loop.max_staleness=1", "loop.steps=3", f"launch.placement={placement}"]
    _, whole = _run(tmp_path, "whole", *stream)
    out, parts = _run(tmp_path, "parts", *stream, "loop.accumulate_groups=3")
    assert len(parts) == len(whole) == 3
    # Step 1 takes the first 8 groups scored, all sampled from version 0, in either run ...
    for key in ("reward", "num_tokens", "num_seqs", "response_len"):
        assert parts[0][key] == whole[0][key], key
    # ... and its gradient is the whole batch's, up to float32 summation order.
    eps = torch.finfo(torch.float32).eps
    assert parts[0]["loss"] == pytest.approx(whole[0]["loss"], abs=1e3 * eps * max(1.0, abs(whole[0]["loss"])))
    rel = 2 ** -8 if torch.cuda.is_available() else 1e-4
    assert parts[0]["grad_norm"] == pytest.approx(whole[0]["grad_norm"], rel=rel)
    assert max(r["staleness_max"] for r in parts) <= 1  # the staleness rule holds as before
    assert sum(s["name"] == "accumulate" for s in read_timeline(out)) == 3 * 3  # parts of 3, 3, 2 per step


@pytest.mark.parametrize("bad, words", [
    (["trainer.mini_batches=2"], "set both to 1"),
    (["algo.advantage=reinforce++"], "whole batch before any advantage"),
    (["launch.trainer_ranks=2", "launch.engines=2"], "one trainer rank"),
])
def test_accumulation_refuses_what_would_change_the_step(bad, words):
    with pytest.raises(Exception, match=words):
        load_config(None, ["loop.accumulate_groups=2", "trainer.mini_batches=1", *bad])


def test_time_share_on_needs_a_colocated_native_engine_at_staleness_0():
    with pytest.raises(Exception, match="launch.time_share=on releases"):
        load_config(None, ["launch.time_share=on", "loop.max_staleness=2"])
    assert load_config(None, ["launch.time_share=off"]).launch.time_share == "off"


def test_accumulate_sms_needs_parts_and_a_gpu(tmp_path, capsys):
    with pytest.raises(Exception, match="loop.accumulate_groups=0 trains none"):
        load_config(None, ["loop.accumulate_sms=96"])
    assert load_config(None, ["loop.accumulate_groups=2", "trainer.mini_batches=1",
                              "loop.accumulate_sms=96"]).loop.accumulate_sms == 96
    if torch.cuda.is_available():
        return  # the refusal below is for a machine without a GPU
    # Refused before the first step, in one line naming the field: no GPU to confine the trainer on.
    out = tmp_path / "run"
    assert main(["train", *RUN, "loop.accumulate_groups=3", "loop.accumulate_sms=96", f"--output-dir={out}"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("loop.accumulate_sms=96 confines the trainer to part of a GPU, and it trains on cpu; "
                            "or set loop.accumulate_sms=0")
    assert "Traceback" not in "\n".join(err)
    assert not (out / "metrics.jsonl").exists() or "eval" not in (out / "metrics.jsonl").read_text()
