"""LoRA on the FSDP2 trainer: 2 CPU ranks (gloo) against LocalTrainer with the same adapters.

As in test_fsdp.py, this file run as a script is each rank's worker; the ranks
rendezvous through a file store, collectives have a 60 s deadline and the job a
240 s one, after which the test fails with the ranks' logs.
"""
from __future__ import annotations

import contextlib
import datetime
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conveyor.config import TrainerConfig
from conveyor.types import Batch

pytestmark = pytest.mark.slow  # two trainer rank processes

WORLD = 2
LENGTHS = [20, 3, 4, 5, 9, 8, 2, 6]
CFG = {"device": "cpu", "lr": 2e-2, "mini_batches": 2, "micro_batch_tokens": 10, "max_grad_norm": 1.0,
       "lora": {"enabled": True, "rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "o_proj", "up_proj"]}}
DEADLINE_S = 240


class Loss:
    needs_entropy = False

    def __call__(self, out, mb, num_tokens, num_seqs):
        m = mb["loss_mask"]
        return -(mb["adv"] * out["logprobs"] * m).sum() / num_tokens, {}


def make_batch(seed: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    ids, masks, adv = [], [], []
    for n in LENGTHS:
        ids.append(torch.randint(7, 90, (n,), generator=gen))
        mask = torch.zeros(n)
        mask[max(1, n // 2):] = 1.0
        masks.append(mask)
        adv.append(torch.randn(n, generator=gen) * mask)
    return Batch(ids, masks, {"adv": adv})


def published(trainer, publish: str) -> dict[str, torch.Tensor]:
    trainer.cfg = trainer.cfg.model_copy(update={"lora": trainer.cfg.lora.model_copy(update={"publish": publish})})
    return {k: v.detach().cpu().clone() for k, v in trainer.named_weights()}


def worker(rank: int, work: Path) -> None:
    import torch.distributed as dist

    from conveyor.trainer.fsdp import FSDPTrainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{work / 'rendezvous'}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    tiny = (work / "tiny_dir").read_text()
    tr = FSDPTrainer(tiny, TrainerConfig(**CFG), total_steps=4)
    res = {"trainable": sorted(n for n, p in tr.model.named_parameters() if p.requires_grad)}
    for seed in range(2):
        tr.train(make_batch(seed), Loss())
    res["merged"], res["adapter"] = published(tr, "merged"), published(tr, "adapter")
    tr.save(work / "ckpt", {})
    tr.export_hf(work / "hf")
    tr.train(make_batch(2), Loss())
    res["after3"] = published(tr, "merged")
    again = FSDPTrainer(tiny, TrainerConfig(**CFG), total_steps=4)
    again.load(work / "ckpt")
    again.train(make_batch(2), Loss())
    res["resumed3"] = published(again, "merged")
    torch.save(res, work / f"rank{rank}.pt")
    dist.destroy_process_group()


def run_job(work: Path) -> list[dict]:
    procs = []
    with contextlib.ExitStack() as logs:
        for rank in range(WORLD):
            log = logs.enter_context(open(work / f"rank{rank}.log", "w"))
            procs.append(subprocess.Popen([sys.executable, __file__, str(rank), str(work)],
                                          stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + DEADLINE_S
        try:
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    if any(p.returncode != 0 for p in procs):
        tails = "\n".join(f"--- rank {r} (rc {p.returncode})\n" + (work / f"rank{r}.log").read_text()[-3000:]
                          for r, p in enumerate(procs))
        pytest.fail(f"FSDP LoRA job failed or passed its {DEADLINE_S} s deadline:\n{tails}")
    return [torch.load(work / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    # float32 on both sides; sharded and whole sums of gradients round differently, and a few
    # AdamW steps of lr 2e-2 can turn that into ~1e-5 of a unit-scale weight.
    return torch.allclose(a, b, rtol=0, atol=1e-4 * max(1.0, float(b.abs().max())))


def test_fsdp_lora_matches_single_device(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from conveyor.trainer.single import LocalTrainer

    (tmp_path / "tiny_dir").write_text(str(tiny_dir))
    ranks = run_job(tmp_path)
    local = LocalTrainer(str(tiny_dir), TrainerConfig(**CFG), total_steps=4)
    for seed in range(2):
        local.train(make_batch(seed), Loss())
    want_m, want_a = published(local, "merged"), published(local, "adapter")
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).state_dict()
    for res in ranks:
        assert res["trainable"] and all(".lora_" in n for n in res["trainable"])
        assert set(res["merged"]) == set(want_m) == set(plain)
        assert set(res["adapter"]) == set(want_a) and all(n.endswith((".lora_A", ".lora_B")) for n in want_a)
        for n in want_m:
            assert close(res["merged"][n], want_m[n]), n
        for n in want_a:
            assert close(res["adapter"][n], want_a[n]), n
        moved = [n for n in plain if not torch.equal(res["merged"][n], plain[n])]
        assert moved and all(n.rsplit(".", 2)[-2] in CFG["lora"]["target_modules"] for n in moved)
        for n in res["after3"]:  # a resumed run takes the same third step
            assert close(res["resumed3"][n], res["after3"][n]), n
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).state_dict()
    for n, t in want_m.items():
        assert close(exported[n], t), n
    assert (tmp_path / "hf" / "adapter" / "adapter_model.safetensors").is_file()


if __name__ == "__main__":
    worker(int(sys.argv[1]), Path(sys.argv[2]))
