"""engine_loop with a real tiny NativeEngine (paged runner, CPU) in a thread, real queues and a
real in-process weight transport: with partial rollouts a chunk that arrives while another
runs joins it and is reported as soon as it ends; evaluation requests, other sampling params
and "stop" wait for the running call to drain; weights published mid-call reach the running
samples and every sample of a chunk that arrives later; without partial rollouts calls stay
waves; a bad chunk is reported as an error."""
from __future__ import annotations

import copy
import queue
import sys
import threading
import time

import pytest

from conveyor.data.tiny import build_model, build_tokenizer
from conveyor.rollout import serve as workers
from conveyor.rollout.api import SamplingParams
from conveyor.rollout.native import NativeEngine
from conveyor.rollout.serve import engine_loop
from conveyor.transport.messages import Done, Failed, Generate, Stop, WeightSwap
from conveyor.transport.weights import StagedWeights

CANDIDATES = ["a", "b", "ok", "c", "no", "The quick brown fox", "hi there", "1+2="]
BUDGET = 40


def tiny(tok, seed=0):
    return build_model(tok, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                       seed=seed).eval()


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny(tok)


@pytest.fixture(scope="module")
def params(tok):
    # Common characters as stop tokens: greedy completions end at very different lengths.
    stops = tuple(tok.convert_tokens_to_ids(list("aeiost")))
    return SamplingParams(temperature=0.0, max_new_tokens=BUDGET, stop_token_ids=stops)


def fast(model, tok):
    return NativeEngine(copy.deepcopy(model), tok, device="cpu", dtype="float32", runner="fast", kv_blocks=64,
                        max_batch=8, refill=1)


@pytest.fixture(scope="module")
def short_long(model, tok, params):
    """A prompt whose greedy completion ends within 3 tokens and one that uses the whole budget."""
    ps = [tok.encode(t) for t in CANDIDATES]
    lengths = [len(g[0].token_ids) for g in fast(model, tok).generate(ps, params)]
    assert min(lengths) <= 3 and BUDGET in lengths, lengths
    return ps[lengths.index(min(lengths))], ps[lengths.index(BUDGET)]


def specs(model):
    return [(n, tuple(t.shape), t.dtype) for n, t in model.state_dict().items()]


def serve(eng, weights, partial=True, timeout_s=600.0):
    inbox, outbox = queue.Queue(), queue.Queue()
    t = threading.Thread(target=engine_loop, args=(eng, inbox, outbox, weights, 0, partial, timeout_s), daemon=True)
    t.start()
    return inbox, outbox, t


def on_decode_step(eng, step: int, action) -> None:
    """Run ``action`` on the generating thread during the engine's ``step``-th decode step."""
    real, count = eng.runner.decode, [0]

    def decode(running, *ahead):
        count[0] += 1
        if count[0] == step:
            action()
        return real(running, *ahead)

    eng.runner.decode = decode


def waiting_for_weights(weights) -> threading.Event:
    """Set once the serve loop waits for a version a chunk was admitted for: a poll from its
    wait loop (``take_version``), after the wait's start was stamped."""
    waiting, real = threading.Event(), weights.poll

    def poll(*args, **kwargs):
        caller = sys._getframe(2)  # poll <- take_weights <- take_version
        if caller.f_code.co_name == "take_version" and caller.f_locals.get("waited_from") is not None:
            waiting.set()
        return real(*args, **kwargs)
    weights.poll = poll
    return waiting


def read(outbox, kind: type, n: int, timeout: float = 15.0) -> list:
    """Every message, in order, up to and including the ``n``-th one of type ``kind``."""
    got, seen, deadline = [], 0, time.monotonic() + timeout
    while seen < n:
        msg = outbox.get(timeout=max(0.01, deadline - time.monotonic()))
        if isinstance(msg, Failed) and kind is not Failed:
            raise AssertionError(f"engine loop failed:\n{msg.traceback}")
        got.append(msg)
        seen += isinstance(msg, kind)
    return got


def messages(outbox, kind: type, n: int) -> list:
    return [m for m in read(outbox, kind, n) if isinstance(m, kind)]


def what(m) -> tuple[str, int]:
    """("weights", version) of a swap, ("done", chunk id) of an answer."""
    return ("weights", m.version) if isinstance(m, WeightSwap) else ("done", m.chunk_id)


def stop(inbox, thread) -> None:
    inbox.put(Stop())
    thread.join(timeout=10)
    assert not thread.is_alive()


def tokens(completions):
    return [[(c.token_ids, c.finish_reason) for c in g] for g in completions]


def test_chunk_joining_a_running_call_is_reported_first(model, tok, params, short_long):
    short, long = short_long
    ref = fast(model, tok)
    # Streaming answers each prompt (group) on its own; waves answer whole chunks.
    for partial, order in [(True, [(1, 0), (1, 1), (0, 0)]), (False, [(0, 0), (1, 0)])]:
        eng = fast(model, tok)
        inbox, outbox, t = serve(eng, StagedWeights(specs(model)), partial)
        on_decode_step(eng, 3, lambda: inbox.put(Generate(1, [short, short], params)))
        inbox.put(Generate(0, [long], params))
        done = messages(outbox, Done, len(order))
        # Streaming: chunk 1 arrived on the 3rd decode step of chunk 0's 40-token sample,
        # joined its batch and ended first. Waves (no partial): it waits for chunk 0.
        assert [(m.chunk_id, m.offset) for m in done] == order, partial
        outs = {}
        for m in done:
            outs.setdefault(m.chunk_id, []).extend(m.completions)
        assert tokens(outs[0]) == tokens(ref.generate([long], params))
        assert tokens(outs[1]) == tokens(ref.generate([short, short], params))
        busy = [m.clock.busy_s for m in done]
        assert 0 < busy[0] <= busy[1] and all(m.clock.idle_s >= 0 for m in done)
        stop(inbox, t)


def test_evaluation_other_params_and_stop_wait_for_the_running_call(model, tok, params, short_long):
    short, long = short_long
    eng = fast(model, tok)
    inbox, outbox, t = serve(eng, StagedWeights(specs(model)))

    def arrive():
        inbox.put(Generate(-1, [long], params))  # evaluation: never merged, nor merges
        # Compatible but behind a held message; short, so it would end first in any call it joined.
        inbox.put(Generate(1, [short], params))
    on_decode_step(eng, 3, arrive)
    inbox.put(Generate(0, [long], params))
    assert [m.chunk_id for m in messages(outbox, Done, 3)] == [0, -1, 1]

    eng = fast(model, tok)
    inbox, outbox, t = serve(eng, StagedWeights(specs(model)))
    other = SamplingParams(temperature=0.0, max_new_tokens=2)

    def arrive_other():
        inbox.put(Generate(11, [short], other))  # different params: served after the call
        inbox.put(Stop())
        inbox.put(Generate(12, [short], params))  # behind "stop": never served
    on_decode_step(eng, 3, arrive_other)
    inbox.put(Generate(10, [long], params))
    done = messages(outbox, Done, 2)
    assert [m.chunk_id for m in done] == [10, 11] and len(done[1].completions[0][0].token_ids) == 2
    t.join(timeout=10)
    assert not t.is_alive() and inbox.get_nowait().chunk_id == 12 and outbox.empty()


def test_weights_published_mid_call_reach_running_and_later_chunks(model, tok, params, short_long, monkeypatch):
    # No watcher: only the poll right before a new chunk enters the engine can apply the
    # update, which is the rule that keeps the staleness bound exact.
    monkeypatch.setattr(workers, "WATCH_WEIGHTS", False)
    _, long = short_long
    other = tiny(tok, seed=7)
    weights = StagedWeights(specs(model))
    eng = fast(model, tok)
    inbox, outbox, t = serve(eng, weights)
    reached, go = threading.Event(), threading.Event()

    def pause_on_step():
        reached.set()
        assert go.wait(10)
    on_decode_step(eng, 3, pause_on_step)
    inbox.put(Generate(0, [long], params))
    assert reached.wait(10)
    weights.publish(other.state_dict().items(), version=1)  # from this thread, as a trainer would
    inbox.put(Generate(1, [long], params))
    go.set()
    log = read(outbox, Done, 2)
    assert [what(m) for m in log] == [("weights", 1), ("done", 0), ("done", 1)]
    done = {m.chunk_id: m.completions[0][0] for m in log if isinstance(m, Done)}
    # Prefill and decode steps 1-3 ran with version 0; the poll before chunk 1 entered swapped.
    assert done[0].versions == [0] * 4 + [1] * (len(done[0].versions) - 4)
    assert done[1].versions == [1] * len(done[1].versions)
    old, new = fast(model, tok), fast(other, tok)
    assert done[0].token_ids[:4] == old.generate([long], params)[0][0].token_ids[:4]
    assert done[1].token_ids == new.generate([long], params)[0][0].token_ids
    # Idle: the loop keeps polling, so a publish between calls is applied without a request.
    weights.publish(model.state_dict().items(), version=2)
    assert messages(outbox, WeightSwap, 1)[0].version == 2 and eng.version == 2
    stop(inbox, t)


def test_a_version_is_swapped_between_two_steps_without_a_new_chunk(model, tok, params, short_long, monkeypatch):
    """With partial rollouts a version published mid-call reaches the running sample at the next
    step although no chunk arrives: the generating thread applies it between two steps (not a
    thread that must first take the engine's lock) and the swap reports when it was served."""
    from conveyor.rollout.native import paged_loop
    _, long = short_long
    other = tiny(tok, seed=7)
    weights = StagedWeights(specs(model))
    eng = fast(model, tok)
    real, calls, swapped_by = paged_loop.sample, [0], []
    real_update = eng.update_weights

    def update_weights(*args, **kwargs):
        swapped_by.append(threading.current_thread().name)
        return real_update(*args, **kwargs)

    def sample(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 5:  # decode step 4 (call 1 samples the prefill's token)
            weights.publish(other.state_dict().items(), version=1)
        return real(*args, **kwargs)
    monkeypatch.setattr(paged_loop, "sample", sample)
    eng.update_weights = update_weights
    inbox, outbox, t = serve(eng, weights)
    t_publish = time.time()
    inbox.put(Generate(0, [long], params))
    log = read(outbox, Done, 1)
    if not any(isinstance(m, WeightSwap) for m in log):  # stamped by the watcher thread: it may come later
        log += read(outbox, WeightSwap, 1)
    assert swapped_by == [t.name]  # the serving thread, between two of its steps
    assert sorted(what(m) for m in log) == [("done", 0), ("weights", 1)]
    log.sort(key=lambda m: not isinstance(m, WeightSwap))
    swap = log[0]
    assert swap.received_at is None and swap.announced_at is None
    assert t_publish < swap.applied_at < time.time() and 0 <= swap.pause_s < 5
    done = log[1].completions[0][0]
    # The prefill's token and decode steps 1-4 ran on version 0, every later step on version 1.
    assert done.versions == [0] * 5 + [1] * (len(done.versions) - 5)
    assert done.token_ids[:5] == fast(model, tok).generate([long], params)[0][0].token_ids[:5]
    assert done.token_ids[5:] != fast(model, tok).generate([long], params)[0][0].token_ids[5:]
    stop(inbox, t)


class _FailingWeights:
    """A transport whose receiver broke: it announces news, and poll raises."""

    received_at = announced_at = None
    version = 0

    def __init__(self):
        self.broken = threading.Event()

    def wait_news(self, engine, timeout):
        return self.broken.wait(timeout)

    def poll(self, engine, engine_id=0):
        if self.broken.is_set():
            raise RuntimeError(f"engine {engine_id} weight receiver failed: the writer died")
        return None


def test_a_weight_watcher_that_fails_reports_the_error_while_the_engine_decodes(model, tok, params, short_long):
    _, long = short_long
    weights = _FailingWeights()
    eng = fast(model, tok)
    inbox, outbox, t = serve(eng, weights)
    on_decode_step(eng, 3, weights.broken.set)  # fails mid-call, nothing else wrong
    inbox.put(Generate(0, [long], params))
    (err,) = messages(outbox, Failed, 1)
    assert err.engine_id == 0 and "engine 0 weight receiver failed: the writer died" in err.traceback
    # The generating thread's own poll (idle, after the call) fails too and ends the loop.
    t.join(timeout=10)
    assert not t.is_alive()


@pytest.mark.parametrize("partial", [True, False])
def test_a_chunk_waits_for_the_version_it_was_admitted_for(model, tok, params, short_long, partial):
    """The loop publishes without waiting for the engines' receives; a chunk admitted for
    version 1 must still not decode a token on version 0 while that publish is on its way."""
    _, long = short_long
    other = tiny(tok, seed=7)
    weights = StagedWeights(specs(model))
    eng = fast(model, tok)
    waiting = waiting_for_weights(weights)
    inbox, outbox, t = serve(eng, weights, partial)
    inbox.put(Generate(0, [long], params, 1))  # admitted for version 1, not yet published
    assert waiting.wait(60)
    assert outbox.empty()  # waiting, not generating on version 0
    weights.publish(other.state_dict().items(), version=1)
    log = read(outbox, Done, 1)
    assert [what(m) for m in log] == [("weights", 1), ("done", 0)]
    done = log[1].completions[0][0]
    assert done.versions == [1] * len(done.token_ids) and done.token_ids
    assert done.token_ids == fast(other, tok).generate([long], params)[0][0].token_ids
    stop(inbox, t)


def test_running_rows_decode_on_while_a_chunk_waits_for_its_version(model, tok, params, short_long, monkeypatch):
    """A chunk admitted for a version still in transfer does not stop the running call: the
    running sample keeps decoding on the old version and the chunk joins once the version is in."""
    _, long = short_long
    other = tiny(tok, seed=7)
    weights = StagedWeights(specs(model))
    eng = fast(model, tok)
    real, count = eng.runner.decode, [0]

    def decode(running, *ahead):
        count[0] += 1
        if count[0] == 3:
            inbox.put(Generate(1, [long], params, 1))  # admitted for version 1, not yet published
        if count[0] == 12:
            weights.publish(other.state_dict().items(), version=1)
        return real(running, *ahead)
    eng.runner.decode = decode
    inbox, outbox, t = serve(eng, weights, timeout_s=5.0)
    inbox.put(Generate(0, [long], params, 0))
    log = read(outbox, Done, 2)
    if not any(isinstance(m, WeightSwap) for m in log):  # the watcher thread stamps the swap: it may
        log += read(outbox, WeightSwap, 1)                 # report after the chunks' answers
    assert sorted(what(m) for m in log) == [("done", 0), ("done", 1), ("weights", 1)]
    done = {m.chunk_id: m.completions[0][0] for m in log if isinstance(m, Done)}
    # Chunk 0 decoded on version 0 from before chunk 1 arrived (step 3) until the publish (step 12).
    first_new = done[0].versions.index(1)
    assert first_new >= 12 and set(done[0].versions[:first_new]) == {0}
    assert done[1].versions == [1] * len(done[1].token_ids)
    assert done[1].token_ids == fast(other, tok).generate([long], params)[0][0].token_ids
    stop(inbox, t)


def test_a_version_that_never_comes_is_a_named_error(model, tok, params, short_long):
    _, long = short_long
    inbox, outbox, t = serve(fast(model, tok), StagedWeights(specs(model)), timeout_s=0.5)
    inbox.put(Generate(3, [long], params, 2))
    (err,) = messages(outbox, Failed, 1)
    assert "engine 0: weights version 2 (a chunk was admitted for it) did not arrive within 0.5s" in err.traceback
    assert "the engine holds version 0" in err.traceback
    t.join(timeout=10)
    assert not t.is_alive()


def test_bad_chunk_is_reported_as_an_error(model, tok, params, short_long):
    short, long = short_long
    eng = fast(model, tok)
    inbox, outbox, t = serve(eng, StagedWeights(specs(model)))
    on_decode_step(eng, 2, lambda: inbox.put(Generate(5, [short, []], params)))
    inbox.put(Generate(4, [long], params))
    (err,) = messages(outbox, Failed, 1)
    assert err.engine_id == 0 and "generate_stream chunk 5: generate: prompt 1 is empty" in err.traceback
    t.join(timeout=10)
    assert not t.is_alive()


@pytest.mark.parametrize("partial", [True, False])
def test_done_messages_carry_the_spans_of_the_work_they_report(model, tok, params, short_long, partial):
    """The timeline's engine rows come from the spans each Done carries: generate calls (a
    streaming call cut at its reports, so the spans tile it), evaluation requests named apart,
    and the wait for a version a chunk was admitted for."""
    short, long = short_long
    weights = StagedWeights(specs(model))
    eng = fast(model, tok)
    waiting = waiting_for_weights(weights)
    inbox, outbox, t = serve(eng, weights, partial)
    before = time.time()
    inbox.put(Generate(0, [long, short], params))
    done = messages(outbox, Done, 1 if not partial else 2)
    inbox.put(Generate(-1, [short], params))  # an evaluation request
    done += messages(outbox, Done, 1)
    inbox.put(Generate(2, [short], params, 1))  # admitted for version 1, published a moment later
    assert waiting.wait(60)  # its wait has begun: it lasts at least the 0.2 s below
    time.sleep(0.2)
    weights.publish(tiny(tok, seed=3).state_dict().items(), version=1)
    done += messages(outbox, Done, 1)
    after = time.time()
    stop(inbox, t)
    spans = [s for m in done for s in m.spans]
    assert {s.track for s in spans} == {"engine 0"}
    assert all(before <= s.start <= s.end <= after for s in spans)
    train = [s for m in done if m.chunk_id == 0 for s in m.spans]
    assert train and {s.name for s in train} == {"generate"}
    if partial:  # one streaming call, cut at its two reports: the spans tile it without overlap
        assert len(train) == 2 and train[0].end == train[1].start
    else:
        assert len(train) == 1 and train[0].args == {"prompts": 2, "chunks": 1}
    assert [s.name for m in done if m.chunk_id == -1 for s in m.spans] == ["generate (eval)"]
    last = [s.name for s in done[-1].spans]
    assert last[0] == "wait for weights" and last[-1] == "generate"
    wait = done[-1].spans[0]
    assert wait.end - wait.start >= 0.15 and wait.args == {"version": 1}


@pytest.mark.parametrize("runner", ["hf", "fast"])
def test_stopping_an_engine_thread_ends_the_generate_call_it_is_in(model, tok, runner):
    # Ctrl-C of an in-process run: the engine's thread must end before the interpreter does (one
    # inside torch at exit aborts the process). A decode step here takes 0.1 s, so the call would
    # run 25 s, past stop_engines' 10 s wait; stopping ends it at its next step.
    from conveyor.launch import roles
    eng = NativeEngine(copy.deepcopy(model), tok, device="cpu", dtype="float32", runner=runner, kv_blocks=64)
    real, decoding = eng.runner.decode, threading.Event()

    def slow(*args, **kwargs):
        decoding.set()
        time.sleep(0.1)
        return real(*args, **kwargs)
    eng.runner.decode = slow
    inbox, outbox, t = serve(eng, StagedWeights(specs(model)), partial=False)
    inbox.put(Generate(0, [tok.encode("a")], SamplingParams(temperature=0.0, max_new_tokens=250), 0))
    assert decoding.wait(60)
    roles.stop_engines([roles.ThreadWorker(0, inbox, t, eng.abort)])
    assert not t.is_alive()
    done = messages(outbox, Done, 1)[0]
    assert done.completions[0][0].finish_reason == "abort"
