"""reward.fn=rm: the reward model checkpoint's checks, its batched scores, normalisation, placement."""
import json
import math

import pytest
import torch

from conveyor.config import ConfigError, load_config
from conveyor.data.tiny import build_tiny
from conveyor.launch.placement import reward_device
from conveyor.reward.api import BatchReward
from conveyor.reward.model import STATS_FILE, RewardModel, RewardModelError, check_checkpoint, encode
from conveyor.reward.service import RewardService
from conveyor.types import Task, Trajectory

TINY = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny causal LM, a reward model made from it (one output) and a two-label classifier."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    root = tmp_path_factory.mktemp("rm")
    lm = build_tiny(root / "lm", **TINY)
    tok = AutoTokenizer.from_pretrained(lm)
    out = {"lm": lm}
    for name, labels in (("rm", 1), ("two", 2)):
        torch.manual_seed(0)
        m = AutoModelForSequenceClassification.from_pretrained(lm, num_labels=labels)
        m.config.pad_token_id = tok.pad_token_id
        with torch.no_grad():  # a head of real size, so scores differ clearly between sequences
            m.score.weight.normal_(0, 1.0)
        m.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        out[name] = root / name
    return out


def traj(prompt: str, text: str, i: int = 0) -> Trajectory:
    return Trajectory(Task(f"t{i}", prompt, None), (), (), (), (), (), text=text)


def test_a_checkpoint_that_is_not_one_scalar_is_refused(checkpoints, tmp_path):
    with pytest.raises(RewardModelError, match=r"is a LlamaForCausalLM model, not a sequence classifier.*train-rm"):
        check_checkpoint(checkpoints["lm"])
    with pytest.raises(RewardModelError, match=r"has 2 outputs \(num_labels=2\); a reward model has one"):
        check_checkpoint(checkpoints["two"])
    with pytest.raises(RewardModelError, match="no config.json"):
        check_checkpoint(tmp_path)
    assert check_checkpoint(checkpoints["rm"]).num_labels == 1
    with pytest.raises(RewardModelError, match="num_labels=2"):
        RewardModel(checkpoints["two"])


def test_batched_scores_equal_each_sequence_scored_alone(checkpoints):
    """Padding, the attention mask and the last-token read-out: a batch of different lengths gives
    each sequence the score the model gives it on its own."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    rm = RewardModel(checkpoints["rm"], device="cpu", max_batch=3)
    assert isinstance(rm, BatchReward) and rm.name == "rm"
    trajs = [traj("rev:abc=", "cba", 0), traj("12+5=", "17", 1), traj("rev:abcdefgh=", "x", 2),
             traj("q", "a much longer completion", 3), traj("rev:zz=", "zz", 4)]
    scores = rm.score_batch(trajs)  # two forward passes: 3 + 2
    model = AutoModelForSequenceClassification.from_pretrained(checkpoints["rm"], dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(checkpoints["rm"])
    alone = []
    with torch.no_grad():
        for t in trajs:
            ids = torch.tensor([encode(tok, t.task.prompt, t.text, 256)])
            alone.append(float(model(input_ids=ids).logits[0, 0]))
    # float32 sums over a 32-wide hidden state: a few ulps of the largest score.
    tol = 1e-5 * max(1.0, max(abs(a) for a in alone))
    assert all(isinstance(s, float) for s in scores)
    assert scores == pytest.approx(alone, abs=tol)
    assert len({round(s, 4) for s in scores}) == len(scores)  # the head tells them apart
    rm.close()
    with pytest.raises(RuntimeError, match="closed"):
        rm.score_batch(trajs[:1])


def test_encoding_ends_with_eos_and_loses_its_left_end_first(checkpoints):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(checkpoints["rm"])
    ids = encode(tok, "rev:abc=", "cba", 256)
    assert tok.decode(ids) == "rev:abc=cba</s>" and ids[-1] == tok.eos_token_id
    assert encode(tok, "rev:abc=", "cba", 5) == ids[-5:]
    with_bos = encode(tok, "<s>rev:", "x", 256)  # a prompt that already holds the BOS gets no second one
    assert with_bos[:1] == [tok.bos_token_id] and with_bos.count(tok.bos_token_id) == 1


def test_normalisation(checkpoints, tmp_path):
    raw = RewardModel(checkpoints["rm"]).score_batch([traj("a", "b"), traj("c", "dd")])
    sig = RewardModel(checkpoints["rm"], normalize="sigmoid").score_batch([traj("a", "b"), traj("c", "dd")])
    assert [d["rm_score"] for d in sig] == pytest.approx(raw, abs=1e-6)
    assert [d["reward"] for d in sig] == pytest.approx([1 / (1 + math.exp(-r)) for r in raw], abs=1e-6)
    with pytest.raises(RewardModelError, match="normalize=standard needs the score mean and std"):
        RewardModel(checkpoints["rm"], normalize="standard")
    (checkpoints["rm"] / STATS_FILE).write_text(json.dumps({"score_mean": 0.5, "score_std": 2.0}))
    try:
        std = RewardModel(checkpoints["rm"], normalize="standard").score_batch([traj("a", "b"), traj("c", "dd")])
    finally:
        (checkpoints["rm"] / STATS_FILE).unlink()
    assert [d["reward"] for d in std] == pytest.approx([(r - 0.5) / 2.0 for r in raw], abs=1e-6)
    with pytest.raises(RewardModelError, match="reward.normalize='minmax'"):
        RewardModel(checkpoints["rm"], normalize="minmax")


def test_the_service_runs_the_reward_model_in_batches(checkpoints):
    rm = RewardModel(checkpoints["rm"], max_batch=4)
    trajs = [traj(f"rev:{c}b=", "b" + c, i) for i, c in enumerate("abcdefghij")]
    expected = RewardModel(checkpoints["rm"], max_batch=16).score_batch(trajs)
    with RewardService(rm, timeout_s=30.0, workers=1, batch_wait_s=0.2) as svc:
        out = svc.score(trajs)
        stats = svc.stats()
    assert [t.reward for t in out] == pytest.approx(expected, abs=1e-5 * max(1.0, max(map(abs, expected))))
    assert stats["batches"] == 3 and stats["scored"] == 10 and stats["failures"] == 0
    assert rm.model is None  # the service closed it


def test_config_and_placement():
    with pytest.raises(ConfigError, match="reward.fn=rm needs reward.model=PATH"):
        load_config(None, ["reward.fn=rm"])
    with pytest.raises(ConfigError, match="reward.device='gpu': give auto, trainer, cpu, cuda or cuda:N"):
        load_config(None, ["reward.device=gpu"])
    cfg = load_config(None, ["reward.fn=rm", "reward.model=/x"])
    assert reward_device(cfg, visible_gpus=0) == "cpu"
    assert reward_device(cfg, visible_gpus=1) == "cuda:0"  # colocated with the trainer
    two = load_config(None, ["reward.fn=rm", "reward.model=/x", "launch.placement=disaggregated",
                             "launch.trainer_ranks=1", "launch.engines=1"])
    assert reward_device(two, visible_gpus=2) == "cuda:0"  # trainer rank 0's GPU; the engine has cuda:1
    assert reward_device(load_config(None, ["reward.device=cuda:1"]), visible_gpus=2) == "cuda:1"
    assert reward_device(load_config(None, ["reward.device=cuda"]), visible_gpus=2) == "cuda:0"
    assert reward_device(load_config(None, ["reward.device=cpu"]), visible_gpus=2) == "cpu"


def test_preflight_refuses_a_reward_device_this_machine_lacks():
    from conveyor.launch.preflight import DeviceError, check_devices
    with pytest.raises(DeviceError, match=r"reward.device=cuda:3 but only 2 CUDA GPU\(s\) are visible"):
        check_devices(load_config(None, ["reward.fn=rm", "reward.model=/x", "reward.device=cuda:3"]),
                      visible_gpus=2)
    check_devices(load_config(None, ["reward.device=cuda:3"]), visible_gpus=0)  # read only with reward.fn=rm


@pytest.mark.parametrize("which, needle", [
    ("lm", ("is a LlamaForCausalLM model, not a sequence classifier with a scalar head; train one from it with "
            "`conveyor train-rm PAIRS.jsonl --model")),
    ("two", "has 2 outputs (num_labels=2); a reward model has one scalar output"),
])
def test_a_run_with_an_unusable_reward_model_stops_before_it_starts(checkpoints, tmp_path, capsys, which, needle):
    from conveyor.cli import main
    run = tmp_path / "run"
    assert main(["train", f"--output-dir={run}", "reward.fn=rm", f"reward.model={checkpoints[which]}",
                 "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64",
                 "data.eval_size=8", "observe.progress=false", "observe.tensorboard=false"]) == 2
    errors = [l for l in capsys.readouterr().err.splitlines() if l.startswith("conveyor: error:")]
    assert len(errors) == 1 and needle in errors[0], errors
    assert f"reward.model '{checkpoints[which]}'" in errors[0]
    assert not (run / "metrics.jsonl").exists() and not (run / "final").exists()  # nothing ran
