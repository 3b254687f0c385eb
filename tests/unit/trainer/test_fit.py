"""The micro-batch budget check before the first step (``trainer/fit.py``): the search for the
largest budget that fits, the one-line refusal naming the field and what fits, and the probe
itself, which changes nothing in the model."""
import pytest
import torch

from conveyor.config import TrainerConfig, load_config
from conveyor.config.base import ConfigError
from conveyor.trainer.fit import check_micro_batches, largest_fitting
from conveyor.trainer.single import LocalTrainer


def test_largest_fitting_halves_until_a_budget_fits():
    seen = []

    def fits(tokens):
        seen.append(tokens)
        return tokens <= 5000

    assert largest_fitting(16384, fits) == 4096 and seen == [16384, 8192, 4096]
    assert largest_fitting(4096, lambda t: True) == 4096
    assert largest_fitting(4096, lambda t: False) is None


class _Trainer:
    """A trainer handle whose device holds micro-batches up to ``limit`` tokens, and more while the
    engine's pool is released (the memory the pool gives back)."""

    def __init__(self, limit, released_extra):
        self.limit, self.extra, self.released, self.told = limit, released_extra, False, []

    def fits(self, tokens, length):
        return tokens <= self.limit + (self.extra if self.released else 0)

    def set_micro_batch_tokens(self, tokens):
        self.told.append(tokens)


class _Memory:
    def __init__(self, trainer):
        self.trainer, self.calls = trainer, []

    def release(self):
        self.trainer.released = True
        self.calls.append("release")

    def reacquire(self):
        self.trainer.released = False
        self.calls.append("reacquire")


def test_a_budget_that_fits_only_without_the_pool_is_checked_with_it_released():
    cfg = load_config(None, ["trainer.micro_batch_tokens=16384", "launch.time_share=on"])
    trainer = _Trainer(limit=4096, released_extra=20000)
    memory = _Memory(trainer)
    check_micro_batches(trainer, cfg, 1024, memory)  # fits once released: accepted
    assert memory.calls == ["release", "reacquire"] and not trainer.released
    with pytest.raises(ConfigError, match=r"trainer.micro_batch_tokens=16384 does not fit .* set "
                                          r"trainer.micro_batch_tokens=8192, or set launch.time_share=on"):
        check_micro_batches(_Trainer(limit=8192, released_extra=0), cfg, 1024, None)


def test_a_default_budget_that_does_not_fit_is_halved_and_the_trainer_told():
    cfg = load_config(None, ["launch.time_share=on"])
    assert cfg.trainer.micro_batch_tokens == 16384 and "micro_batch_tokens" not in cfg.trainer.model_fields_set
    trainer = _Trainer(limit=1024, released_extra=4000)  # 4096 fits once the pool is released
    notes = check_micro_batches(trainer, cfg, 512, _Memory(trainer))
    assert trainer.told == [4096] and cfg.trainer.micro_batch_tokens == 4096
    assert notes == ["trainer.micro_batch_tokens: the default 16384 does not fit the trainer's GPU memory with the "
                     "engine's KV pool released; using 4096, the largest halving that fits"]
    # the same budget written out is the user's: refused, naming what fits, and nothing changed
    cfg = load_config(None, ["launch.time_share=on", "trainer.micro_batch_tokens=16384"])
    trainer = _Trainer(limit=1024, released_extra=4000)
    with pytest.raises(ConfigError, match=r"micro_batch_tokens=16384 does not fit .* set trainer.micro_batch_tokens=4096"):
        check_micro_batches(trainer, cfg, 512, _Memory(trainer))
    assert trainer.told == [] and cfg.trainer.micro_batch_tokens == 16384
    # a default of which no halving fits is refused too
    with pytest.raises(ConfigError, match=r"micro_batch_tokens=16384 does not fit .* no smaller budget fit either"):
        check_micro_batches(_Trainer(limit=0, released_extra=0), load_config(None, []), 512, None)


def test_the_trainer_host_hands_the_new_budget_to_its_trainer(tiny_dir):
    from conveyor.trainer.serve import TrainerHost
    trainer = LocalTrainer(str(tiny_dir), TrainerConfig(device="cpu"), total_steps=1)
    TrainerHost(trainer, []).set_micro_batch_tokens(2048)
    assert trainer.cfg.micro_batch_tokens == 2048


def test_the_shared_budget_is_checked_beside_the_held_pool():
    cfg = load_config(None, ["trainer.micro_batch_tokens=16384", "trainer.micro_batch_tokens_shared=8192",
                             "loop.accumulate_groups=2", "trainer.mini_batches=1", "launch.time_share=on"])
    trainer = _Trainer(limit=2048, released_extra=20000)
    with pytest.raises(ConfigError, match=r"micro_batch_tokens_shared=8192 does not fit .* beside the engine's KV "
                                          r"pool .* set trainer.micro_batch_tokens_shared=2048"):
        check_micro_batches(trainer, cfg, 512, _Memory(trainer))


@pytest.mark.parametrize("pack, critic", [("off", False), ("on", False), ("off", True)])  # the step's path
def test_the_probe_changes_nothing_and_fits_on_cpu(tiny_dir, pack, critic):
    trainer = LocalTrainer(str(tiny_dir), TrainerConfig(device="cpu", pack_sequences=pack, critic=critic),
                           total_steps=1)
    models = [trainer.model] + ([trainer.critic] if critic else [])
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in models]
    assert trainer.fits(4096, 64)  # host memory is not probed
    ran = []
    for m in models:
        m.register_forward_hook(lambda *_, m=m: ran.append(m))
    trainer._probe(512, 64)  # the forward and backward the GPU check runs
    assert len(ran) == len(models) and (not critic or ran[-1] is trainer.critic)  # a critic is in the step's loss
    for m, b in zip(models, before):
        assert all(torch.equal(b[k], v) for k, v in m.state_dict().items())
        assert all(p.grad is None for p in m.parameters())


def test_the_probe_counts_the_optimizer_state_the_first_step_will_create(tiny_dir):
    trainer = LocalTrainer(str(tiny_dir), TrainerConfig(device="cpu"), total_steps=1)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    assert trainer._state_to_come() == 2 * sum(p.numel() * p.element_size() for p in params)  # AdamW: two moments
    for p in params:
        p.grad = torch.zeros_like(p)
    trainer.optimizer.step()
    assert trainer._state_to_come() == 0  # created: the memory already holds it


@pytest.mark.skipif(not torch.cuda.is_available(), reason="probes GPU memory")
def test_the_gpu_probe_says_no_to_what_cannot_fit_and_recovers(tiny_dir):
    trainer = LocalTrainer(str(tiny_dir), TrainerConfig(device="cuda"), total_steps=1)
    free = torch.cuda.mem_get_info()[0]
    # The tiny model's logits alone (vocab x 4 bytes a token) outgrow the free memory here.
    huge = int(2 * free / (trainer.model.config.vocab_size * 4))
    assert not trainer.fits(huge, 4096)
    assert trainer.fits(4096, 64)  # the failed probe left nothing behind
    assert all(p.grad is None for p in trainer.model.parameters())


class _Fits:
    """A trainer handle whose memory holds micro-batches of up to ``limit`` tokens."""

    def __init__(self, limit):
        self.limit, self.asked = limit, []

    def fits(self, tokens, length):
        self.asked.append((tokens, length))
        return tokens <= self.limit


def test_time_share_auto_releases_the_pool_only_when_the_micro_batch_needs_it():
    from conveyor.config import load_config
    from conveyor.trainer.fit import needs_time_share
    cfg = load_config(None, ["trainer.micro_batch_tokens=16384"])
    roomy, tight = _Fits(32768), _Fits(8192)
    assert not needs_time_share(roomy, cfg, 1152)
    assert needs_time_share(tight, cfg, 1152)
    assert roomy.asked == tight.asked == [(16384, 1152)]  # one probe of the budget, rows as long as a sample


def test_a_trainer_gpu_no_engine_uses_starts_from_the_larger_default():
    from conveyor.launch.placement import Placement
    from conveyor.trainer.fit import OWN_GPU_MICRO_BATCH_TOKENS, own_gpu_default
    assert Placement(["cuda:0"], ["cuda:1"], "broadcast").trainer_alone
    assert Placement(["cuda:0", "cuda:1"], ["cuda:2"], "broadcast").trainer_alone
    assert not Placement(["cuda:0"], ["cuda:0"], "ipc").trainer_alone  # beside an engine
    assert not Placement(["cuda:0"], ["cuda:0"], "inprocess").trainer_alone
    assert not Placement(["cuda:0", "cuda:1"], ["cuda:1"], "ipc").trainer_alone  # one rank shares
    assert not Placement(["cpu"], ["cpu"], "shm").trainer_alone
    cfg = load_config(None, [])
    assert own_gpu_default(cfg, True) == OWN_GPU_MICRO_BATCH_TOKENS > cfg.trainer.micro_batch_tokens
    assert own_gpu_default(cfg, False) is None
    assert own_gpu_default(load_config(None, ["trainer.micro_batch_tokens=8192"]), True) is None  # set: it stands


def test_the_own_gpu_default_is_still_a_default_halved_when_it_does_not_fit():
    cfg = load_config(None, [])
    trainer = _Trainer(limit=40000, released_extra=0)
    notes = check_micro_batches(trainer, cfg, 1024, None, default=32768)
    assert trainer.told == [32768] and cfg.trainer.micro_batch_tokens == 32768
    assert "micro_batch_tokens" not in cfg.trainer.model_fields_set
    assert notes == ["trainer.micro_batch_tokens: 32768, the default for a trainer whose GPUs no engine uses"]
    cfg = load_config(None, [])
    trainer = _Trainer(limit=20000, released_extra=0)
    notes = check_micro_batches(trainer, cfg, 1024, None, default=32768)
    assert trainer.told == [32768, 16384] and cfg.trainer.micro_batch_tokens == 16384
    assert notes == ["trainer.micro_batch_tokens: the default 32768 does not fit the trainer's GPU memory on a GPU "
                     "no engine uses; using 16384, the largest halving that fits"]
    # a budget the user set is not replaced
    cfg = load_config(None, ["trainer.micro_batch_tokens=8192"])
    trainer = _Trainer(limit=40000, released_extra=0)
    assert check_micro_batches(trainer, cfg, 1024, None, default=32768) == []
    assert trainer.told == [] and cfg.trainer.micro_batch_tokens == 8192
