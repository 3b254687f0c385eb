"""Reward model on a GPU: scores equal the CPU's (bf16 and fp32 checkpoints), train-rm with autocast, the service."""
import json, sys, time, torch, tempfile
from pathlib import Path
sys.path.insert(0, "src")
from conveyor.data.tiny import build_tiny
from conveyor.reward.model import RewardModel
from conveyor.reward.service import RewardService
from conveyor.reward.train_rm import RMTrainConfig, train_reward_model
from conveyor.data.preferences import synthetic_pairs, write_pairs
from conveyor.types import Task, Trajectory
print(torch.__version__, torch.cuda.get_device_name(0))
d = Path(tempfile.mkdtemp())
lm = build_tiny(d / "lm", hidden_size=128, num_layers=4)
write_pairs(d / "pairs.jsonl", synthetic_pairs("reverse", 3000, {"length": 4}, eval_size=100))
t = time.time()
r = train_reward_model(RMTrainConfig(str(d / "pairs.jsonl"), str(lm), str(d / "rm"), lr=1e-3, batch_size=64, steps=300,
                                     eval_every=100, device="cuda"), log=print)
print("train-rm on cuda:", round(time.time() - t, 1), "s")
trajs = [Trajectory(Task(f"t{i}", p.prompt, None), (), (), (), (), (), text=c)
         for i, p in enumerate(synthetic_pairs("reverse", 200, {"length": 4}, eval_size=100, seed=3)) for c in (p.chosen, p.rejected)]
cpu = RewardModel(d / "rm", "cpu", 64).score_batch(trajs)
gpu_rm = RewardModel(d / "rm", "cuda:0", 64)
print("gpu dtype", next(gpu_rm.model.parameters()).dtype)
with RewardService(gpu_rm, timeout_s=10, workers=2, batch_wait_s=0.02) as svc:
    t = time.time(); out = svc.score(trajs); dt = time.time() - t
    print("service on cuda:", len(trajs) / dt, "traj/s", svc.stats())
gpu = [x.reward for x in out]
print("max |gpu - cpu|", max(abs(a - b) for a, b in zip(gpu, cpu)), "max |cpu|", max(map(abs, cpu)))
acc_cpu = sum(cpu[i] > cpu[i + 1] for i in range(0, len(cpu), 2)) / (len(cpu) // 2)
acc_gpu = sum(gpu[i] > gpu[i + 1] for i in range(0, len(gpu), 2)) / (len(gpu) // 2)
print("pair accuracy cpu", acc_cpu, "gpu", acc_gpu, "train-rm held-out", r.final.accuracy)
# a bf16 checkpoint stays bf16 on the GPU
from transformers import AutoModelForSequenceClassification
m = AutoModelForSequenceClassification.from_pretrained(d / "rm", dtype=torch.bfloat16); m.save_pretrained(d / "rm16")
import shutil
for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
    if (d / "rm" / f).exists(): shutil.copy(d / "rm" / f, d / "rm16" / f)
b = RewardModel(d / "rm16", "cuda:0", 64)
print("bf16 ckpt dtype on gpu", next(b.model.parameters()).dtype)
bs = b.score_batch(trajs)
print("bf16 max |diff| vs fp32 cpu", max(abs(a - c) for a, c in zip(bs, cpu)))
b.close(); print("closed; allocated", torch.cuda.memory_allocated())
