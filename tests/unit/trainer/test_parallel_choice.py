"""trainer.parallel=auto: whole-model ranks where the training state fits twice in a GPU's memory,
sharded ranks elsewhere and on CPU ranks, the same on every rank (two gloo processes); a resume keeps
the kind that wrote its checkpoint."""
from __future__ import annotations

import pytest
import torch

from conveyor.config import TrainerConfig
from conveyor.data.tiny import build_tiny
from conveyor.trainer import serve
from conveyor.trainer.checkpoint import SHARDED_MARKER, reader_of
from conveyor.trainer.models import training_state_bytes


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny"), hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=128)


def _params(path) -> int:
    from transformers import AutoModelForCausalLM
    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(path)).parameters())


def test_training_state_counts_every_copy_the_trainer_keeps(tiny):
    n = _params(tiny)
    assert training_state_bytes(tiny, TrainerConfig()) == 18 * n  # fp32 weights, grads, 2 moments, bf16 copy
    assert training_state_bytes(tiny, TrainerConfig(reference=True, critic=True)) == (18 + 4 + 16) * n
    assert training_state_bytes(tiny, TrainerConfig(lora={"enabled": True})) == 4 * n  # frozen fp32 base


def test_auto_is_replicate_only_where_the_state_fits_twice(tiny, monkeypatch):
    need = training_state_bytes(tiny, TrainerConfig())
    for asked in ("fsdp", "replicate"):  # asked for: kept, wherever
        assert serve.choose_parallel(TrainerConfig(parallel=asked), str(tiny), "cpu") == asked
    assert serve.choose_parallel(TrainerConfig(), str(tiny), "cpu") == "fsdp"  # auto on CPU ranks
    # The GPU's free memory, as CUDA reports it (no GPU here: the query is what varies).
    for free, want in ((2 * need, "replicate"), (2 * need - 1, "fsdp")):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda _d, f=free: (f, 4 * f))
        assert serve.choose_parallel(TrainerConfig(), str(tiny), "cuda:0") == want


def test_a_resume_reads_its_checkpoint_with_the_kind_that_wrote_it(tmp_path):
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    whole.mkdir()
    sharded.mkdir()
    (sharded / SHARDED_MARKER).write_text("{}")
    assert reader_of(whole) == "replicate" and reader_of(sharded) == "fsdp"


_AGREE = """
import sys, torch.distributed as dist
from conveyor.trainer.serve import _agreed_parallel
rank, mine, store = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
print(_agreed_parallel(mine, "cpu"))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("answers,agreed", [(("replicate", "replicate"), "replicate"),
                                            (("replicate", "fsdp"), "fsdp"), (("fsdp", "replicate"), "fsdp")])
def test_the_ranks_agree_on_replicate_only_if_every_rank_can(tmp_path, answers, agreed):
    import subprocess
    import sys
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, "-c", _AGREE, str(r), mine, str(store)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r, mine in enumerate(answers)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    assert [out.strip() for out, _ in outs] == [agreed, agreed]
