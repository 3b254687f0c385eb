"""The loop's engine metrics: idle fractions per engine, and the decode-step size and time over all engines."""
import pytest

from conveyor.controller.step_stats import engine_stats
from conveyor.transport.messages import EngineClock


def test_engine_stats_are_deltas_since_the_last_step():
    e0 = EngineClock(1.0, 1.0, dict(decode_steps=10, decode_rows=100, decode_s=0.05, prefill_s=0.1))
    e1 = EngineClock(0.0, 0.0)  # an engine that keeps no counters (the HF runner, a remote server)
    last = {0: EngineClock(), 1: EngineClock()}
    out = engine_stats({0: e0, 1: e1}, last)
    assert out["engine0_idle_frac"] == pytest.approx(0.5) and "engine1_idle_frac" not in out
    assert out["engine_batch_mean"] == pytest.approx(10.0) and out["engine_step_ms"] == pytest.approx(5.0)
    assert out["engine_prefill_frac"] == pytest.approx(0.1)
    # the next step: 30 steps of 20 rows at 2 ms, no prefill, busy the whole 1.5 s
    e0 = EngineClock(2.5, 1.0, dict(decode_steps=40, decode_rows=700, decode_s=0.11, prefill_s=0.1))
    out = engine_stats({0: e0, 1: e1}, last)
    assert out["engine0_idle_frac"] == pytest.approx(0.0)
    assert out["engine_batch_mean"] == pytest.approx(20.0) and out["engine_step_ms"] == pytest.approx(2.0)
    assert out["engine_prefill_frac"] == pytest.approx(0.0)
    assert "engine_device_wait_frac" not in out  # an engine that does not count its waits: nothing claimed
    # the host waited 0.6 s of the next 1.5 busy seconds for the device
    e0 = EngineClock(4.0, 1.0, dict(decode_steps=70, decode_rows=1300, decode_s=1.51, prefill_s=0.1,
                                    device_wait_s=0.6))
    out = engine_stats({0: e0, 1: e1}, last)
    assert out["engine_device_wait_frac"] == pytest.approx(0.4)
    # nothing decoded since: no step stats rather than a division by zero
    out = engine_stats({0: e0, 1: e1}, last)
    assert "engine_step_ms" not in out and "engine_batch_mean" not in out


def test_the_share_of_decode_time_at_few_rows_is_counted_against_the_steps_sequences():
    from conveyor.transport.messages import rows_key
    assert [rows_key(r) for r in (1, 2, 3, 4, 5, 128, 129)] == [
        f"decode_s_rows_le_{b}" for b in (1, 2, 4, 4, 8, 128, 256)]
    # 256 sequences a step on one engine: steps of at most 128 rows are the low ones
    counters = dict(decode_steps=30, decode_rows=3000, decode_s=1.0, prefill_s=0.0,
                    **{rows_key(256): 0.5, rows_key(128): 0.3, rows_key(16): 0.2})
    last = {0: EngineClock()}
    out = engine_stats({0: EngineClock(1.0, 0.0, counters)}, last, rows=256)
    assert out["engine_low_rows_frac"] == pytest.approx(0.5)
    # the same step over two engines: each is given 128 sequences, so only steps of <= 64 rows count
    last = {0: EngineClock(), 1: EngineClock()}
    out = engine_stats({0: EngineClock(1.0, 0.0, counters), 1: EngineClock(1.0, 0.0, counters)}, last, rows=256)
    assert out["engine_low_rows_frac"] == pytest.approx(0.2)
    # 200 sequences: half is 100, rounded down to the 64 the buckets can tell apart
    last = {0: EngineClock()}
    out = engine_stats({0: EngineClock(1.0, 0.0, counters)}, last, rows=200)
    assert out["engine_low_rows_frac"] == pytest.approx(0.2)
    # without the step's size, or without counts by rows (an older engine), nothing is claimed
    last = {0: EngineClock()}
    assert "engine_low_rows_frac" not in engine_stats({0: EngineClock(1.0, 0.0, counters)}, last)
    last = {0: EngineClock()}
    plain = dict(decode_steps=30, decode_rows=3000, decode_s=1.0, prefill_s=0.0)
    assert "engine_low_rows_frac" not in engine_stats({0: EngineClock(1.0, 0.0, plain)}, last, rows=256)
