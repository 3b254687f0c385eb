"""Every launcher provides the role handles the controller holds, exactly as their Protocols say.

The same checks run against each launcher's handles (``LocalLauncher`` in one
process, and with roles in child processes): every member of the contract is
there with the Protocol's signature (parameter names, kinds and defaults),
nothing is forwarded by ``__getattr__``, declared capability fields exist,
and the handles work on a tiny CPU model: a trainer step published as
version 1 reaches the engine before the chunk admitted for it starts.
Engines and weight transports are checked the same way against
``RolloutEngine``, ``WeightWriter`` and ``WeightReader``. A handle that lacks
part of a contract fails here.
"""
from __future__ import annotations

import inspect
import queue
import time
import typing

import pytest
import torch

from conveyor.config import load_config
from conveyor.controller.objective import sft_loss
from conveyor.launch.api import Engines, Launcher
from conveyor.launch.local import LocalLauncher
from conveyor.rollout.api import EngineWorker, RolloutEngine, SamplingParams
from conveyor.run.session import resolve_model_path
from conveyor.trainer.api import Trainer, TrainerHandle, TrainerLifecycle, TrainerSteps
from conveyor.transport.api import WeightReader, WeightWriter
from conveyor.transport.messages import Done, Failed, Generate, Trained, WeightSwap
from conveyor.types import Batch

TINY = ["sft.steps=0", "loop.batch_size=2", "rollout.n=2", "rollout.max_new_tokens=4", "data.eval_size=4",
        "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64",
        "observe.tensorboard=false", "observe.progress=false", "launch.engine_threads=1",
        "launch.trainer_threads=1", "launch.timeout_s=120"]
LAUNCHES = {"in-process": ["launch.placement=colocated"],
            "processes": ["launch.placement=disaggregated"]}


def members(proto) -> set[str]:
    return set(typing._get_protocol_attrs(proto))  # the names a runtime isinstance check looks for


def shape(fn) -> list[tuple]:
    """A callable's parameters as (name, kind, has a default), ``self`` left out."""
    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].name == "self":
        params = params[1:]
    return [(p.name, p.kind, p.default is not inspect.Parameter.empty) for p in params]


def same_call(have, want) -> bool:
    """``have`` takes the Protocol's parameters in order; any it adds after them are optional."""
    h, w = shape(have), shape(want)
    return h[:len(w)] == w and all(default for _, _, default in h[len(w):])


def conforms(obj, proto) -> None:
    """``obj`` (an instance, or a class for members set on the class) has every member of ``proto``,
    each method callable as the Protocol's, and forwards nothing through ``__getattr__``."""
    cls = obj if isinstance(obj, type) else type(obj)
    assert "__getattr__" not in vars(cls), f"{cls.__name__} forwards attributes: the contract must be explicit"
    for name in sorted(members(proto)):
        assert hasattr(obj, name), f"{cls.__name__} lacks {proto.__name__}.{name}"
        want = inspect.getattr_static(proto, name, None)
        have = inspect.getattr_static(cls, name, None)
        if inspect.isfunction(want):
            assert inspect.isfunction(have), f"{cls.__name__}.{name} must be a method of {proto.__name__}"
            assert same_call(have, want), f"{cls.__name__}.{name}{inspect.signature(have)} differs from " \
                                               f"{proto.__name__}.{name}{inspect.signature(want)}"
    if not isinstance(obj, type):
        assert isinstance(obj, proto)


# the launch with role processes takes seconds to start them: `pytest -m "not slow"` leaves it out
@pytest.fixture(scope="module", params=[pytest.param(k, marks=pytest.mark.slow) if k == "processes" else k
                                        for k in sorted(LAUNCHES)])
def launched(request, tmp_path_factory):
    from transformers import AutoTokenizer
    run_dir = tmp_path_factory.mktemp(request.param)
    cfg = load_config(None, TINY + LAUNCHES[request.param])
    path = resolve_model_path(cfg, run_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    launcher = LocalLauncher(cfg, run_dir)
    engines = launcher.start_engines(path, tokenizer)
    trainer = launcher.start_trainer(path, tokenizer)
    try:
        yield launcher, engines, trainer, tokenizer
    finally:
        trainer.close()
        launcher.stop_engines(engines.workers)


def test_the_launcher_and_its_handles_meet_their_protocols(launched):
    launcher, engines, trainer, _ = launched
    conforms(launcher, Launcher)
    assert launcher.trainer_gpus_alone() is False  # CPU roles
    assert isinstance(engines, Engines) and engines.context_limit > 1 and engines.workers
    for w in engines.workers:
        conforms(w, EngineWorker)
        w.check()
    conforms(trainer, TrainerHandle)
    for surface in (TrainerSteps, TrainerLifecycle):  # what the loop holds, and what only run/ holds
        conforms(trainer, surface)
    for writers in launcher.routes.writers.values():
        for w in writers:
            conforms(w, WeightWriter)
    for reader in launcher.routes.readers.values():
        conforms(reader, WeightReader)


def test_a_published_step_reaches_the_chunk_admitted_for_it(launched):
    _, engines, trainer, tokenizer = launched
    assert trainer.step() == 0 and isinstance(trainer.publish(0), float)
    ids = torch.tensor(tokenizer("1+2=")["input_ids"] + [5, 6, 7])
    mask = torch.zeros(len(ids))
    mask[-3:] = 1.0
    batch = Batch([ids], [mask])
    (lp,) = trainer.logprobs(batch)
    assert lp.shape == ids.shape and lp.dtype == torch.float32
    trained = trainer.train_and_publish(batch, sft_loss, 1)
    assert isinstance(trained, Trained) and trained.step_ended > 0 and trainer.step() == 1
    params = SamplingParams(temperature=0.0, max_new_tokens=3)
    engines.workers[0].send(Generate(0, [ids[:4].tolist()], params, version=1))
    swapped, deadline = [], time.monotonic() + 60
    while True:
        msg = engines.outbox.get(timeout=max(0.01, deadline - time.monotonic()))
        assert not isinstance(msg, Failed), msg.traceback
        if isinstance(msg, WeightSwap):
            swapped.append(msg.version)
        if isinstance(msg, Done):
            break
    assert 1 in swapped and msg.chunk_id == 0 and msg.offset == 0
    (samples,) = msg.completions
    assert samples[0].versions == [1] * len(samples[0].token_ids)
    with pytest.raises(queue.Empty):
        engines.outbox.get(timeout=0.05)


def test_the_trainer_handle_is_the_loops_surface_and_runs():
    steps, lifecycle = members(TrainerSteps), members(TrainerLifecycle)
    assert not steps & lifecycle and steps | lifecycle == members(TrainerHandle)
    assert {"train_and_publish", "accumulate", "finish_and_publish", "logprobs"} <= steps
    assert {"save_checkpoint", "load_checkpoint", "export_hf", "close", "fits", "describe"} <= lifecycle
    from conveyor.launch.roles import TrainerProxy
    from conveyor.trainer.serve import TrainerHost
    for cls in (TrainerHost, TrainerProxy):  # RayTrainerProxy is a TrainerProxy; its calls go through _call
        conforms(cls, TrainerSteps)
        conforms(cls, TrainerLifecycle)


def test_every_engine_and_trainer_declares_its_contract():
    from conveyor.data.tiny import build_model, build_tokenizer
    from conveyor.rollout.native import NativeEngine
    from conveyor.rollout.remote import RemoteEngine
    from conveyor.rollout.vllm import VLLMEngine
    from conveyor.trainer.fsdp import FSDPTrainer
    from conveyor.trainer.single import LocalTrainer
    tok = build_tokenizer()
    engine = NativeEngine(build_model(tok, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                                      intermediate_size=64, seed=0), tok, device="cpu", dtype="float32")
    conforms(engine, RolloutEngine)
    assert engine.cuda_device is None and isinstance(engine.streams, bool)
    for cls in (VLLMEngine, RemoteEngine):  # their fields set in __init__ are checked where they run
        assert cls.streams is False and cls.cuda_device is None
        for name in ("generate", "update_weights", "close"):
            assert same_call(getattr(cls, name), getattr(RolloutEngine, name)), (cls, name)
    for cls in (LocalTrainer, FSDPTrainer):
        assert isinstance(cls.streams_publish, bool) and isinstance(cls.step_ended, float)
        for name in members(Trainer) - {"streams_publish", "step_ended", "step"}:
            assert hasattr(cls, name), (cls, name)
