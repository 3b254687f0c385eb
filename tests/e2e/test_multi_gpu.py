"""Several GPUs (skipped without two): NCCL weight broadcast, FSDP2 ranks beside their engines.

- disaggregated, 1 trainer GPU + 1 engine GPU, weights by NCCL broadcast, max_staleness 0:
  the same rewards and (to float tolerance) the same weights as the in-process run;
- colocated over 2 GPUs: 2 FSDP2 ranks, and 2 whole-model ranks (what ``trainer.parallel:
  auto`` picks for a model this small), engine i beside rank i, weights by CUDA IPC;
- a placement that needs more GPUs than are visible is refused by name.
"""
import pytest
import torch
from safetensors.torch import load_file

from conveyor.config import load_config
from conveyor.observe.report import read_metrics
from conveyor.run.local import run_local
from conveyor.runtime.errors import SetupError

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two GPUs")]

TINY = ["sft.steps=0", "loop.batch_size=8", "rollout.n=4", "data.eval_size=8", "loop.eval_every=0",
        "model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.intermediate_size=128",
        "loop.time_limit_s=null", "observe.tensorboard=false", "observe.progress=false", "loop.steps=3",
        "trainer.lr=1e-3", "rollout.kv_fraction=0.05", "launch.timeout_s=300"]


def _run(tmp_path, name, extra):
    run_dir = tmp_path / name
    run_local(load_config(None, TINY + extra), run_dir)
    return run_dir, read_metrics(run_dir, kind="train"), load_file(str(run_dir / "final" / "model.safetensors"))


def test_broadcast_and_fsdp_runs_match_the_in_process_run(tmp_path, capsys):
    _, ma, wa = _run(tmp_path, "inprocess", [])
    for name, extra in {"broadcast": ["launch.placement=disaggregated"],
                        "colocated-fsdp2": ["launch.trainer_ranks=2", "launch.engines=2", "trainer.parallel=fsdp"],
                        "colocated-auto": ["launch.trainer_ranks=2", "launch.engines=2"]}.items():
        capsys.readouterr()
        _, mb, wb = _run(tmp_path, name, extra)
        said = capsys.readouterr().err
        if name == "colocated-fsdp2":
            assert "FSDP2, the model sharded over them (fsdp)" in said, said
        if name == "colocated-auto":  # a tiny model fits every GPU: the ranks agree (over NCCL) on whole copies
            assert "(replicate, chosen by trainer.parallel=auto)" in said, said
        assert len(mb) == 3 and all(m["staleness_max"] == 0 for m in mb), name
        assert all(m["weight_publish_ms"] > 0 for m in mb), name
        assert all(torch.isfinite(t).all() for t in wb.values()), name
        if name == "broadcast":  # the same trainer code on one GPU: the same samples
            assert [m["reward"] for m in mb] == [m["reward"] for m in ma]
            for k in wa:
                torch.testing.assert_close(wb[k], wa[k], rtol=0.02, atol=2e-3, msg=f"{name}: {k}")
        else:  # two engines draw different samples; the point is that it trains through IPC
            assert any(not torch.equal(wb[k], wa[k]) for k in wa)


def test_placement_larger_than_the_machine_is_refused(tmp_path):
    n = torch.cuda.device_count()
    with pytest.raises(SetupError, match=f"= {n + 1} GPUs but {n} are visible"):
        run_local(load_config(None, TINY + ["launch.placement=disaggregated", f"launch.engines={n}"]),
                  tmp_path / "big")
