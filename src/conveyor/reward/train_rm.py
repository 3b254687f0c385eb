"""Train a reward model on preference pairs with the Bradley-Terry loss (``conveyor train-rm``).

- ``train_reward_model(cfg: RMTrainConfig, log) -> RMTrainResult`` checks every pair first
  (a broken row is a ``DataError``, nothing is trained), then minimises
  ``-log sigmoid(r(chosen) - r(rejected))``, evaluating on held-out prompts never trained on.
- Its output is a checkpoint ``reward.fn: rm`` loads, with ``model.STATS_FILE``; sequences are
  encoded by ``model.encode``, exactly as during RL.

It knows nothing of the RL loop, of rollouts or of where the pairs came from.
"""
from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from conveyor.data.api import DataError
from conveyor.data.preferences import PreferencePair, prompt_text, read_pairs
from conveyor.reward.model import (STATS_FILE, RewardModelError, check_checkpoint, context_length, encode,
                                   sequence_scores, set_pad_token)


@dataclass(frozen=True)
class RMTrainConfig:
    """What ``conveyor train-rm`` takes; the CLI's flags have the same names."""
    data: str
    model: str
    out: str
    eval_data: str | None = None
    eval_fraction: float = 0.1
    epochs: float = 1.0
    steps: int | None = None  # default: epochs over the training pairs
    batch_size: int = 16
    micro_batch: int | None = None  # pairs per forward pass; default batch_size
    lr: float = 1e-5
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    eval_every: int = 100
    max_length: int | None = None  # default: the model's context
    seed: int = 0
    device: str = "auto"

    def __post_init__(self) -> None:
        bad = [f"{name} must be {rule}" for name, ok, rule in (
            ("--eval-fraction", 0.0 < self.eval_fraction < 1.0, "in (0, 1)"),
            ("--epochs", self.epochs > 0, "> 0"),
            ("--steps", self.steps is None or self.steps >= 1, ">= 1"),
            ("--batch-size", self.batch_size >= 1, ">= 1"),
            ("--micro-batch", self.micro_batch is None or self.micro_batch >= 1, ">= 1"),
            ("--lr", self.lr > 0, "> 0"),
            ("--eval-every", self.eval_every >= 0, ">= 0 (0: only before and after training)"),
            ("--max-length", self.max_length is None or self.max_length >= 2, ">= 2")) if not ok]
        if bad:
            raise DataError(f"train-rm: {'; '.join(bad)}")


@dataclass(frozen=True)
class Evaluation:
    step: int
    loss: float
    accuracy: float
    pairs: int


@dataclass(frozen=True)
class RMTrainResult:
    out: Path
    steps: int
    train_pairs: int
    heldout_pairs: int
    final: Evaluation
    score_mean: float
    score_std: float
    history: list[Evaluation] = field(default_factory=list)


def split_pairs(pairs: list[PreferencePair], fraction: float, seed: int) -> tuple[list, list]:
    """(train, held out): a seeded ``fraction`` of the distinct prompts, with all their pairs, held out."""
    prompts = sorted({json.dumps(p.prompt) for p in pairs})
    if len(prompts) < 2:
        raise DataError("train-rm needs pairs of at least two different prompts to hold some out; "
                        "add pairs or give --eval-data")
    held = set(random.Random(f"rm-split-{seed}").sample(prompts, max(1, min(len(prompts) - 1,
                                                                           round(fraction * len(prompts))))))
    return ([p for p in pairs if json.dumps(p.prompt) not in held], [p for p in pairs if json.dumps(p.prompt) in held])


def load_base(path: str, device: Any) -> tuple[Any, Any, str]:
    """The model to train, its tokenizer, and what it was (for the first line)."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
    if not (Path(path).expanduser() / "config.json").is_file():
        raise RewardModelError(f"--model {path!r} is not a Hugging Face checkpoint directory (no config.json); "
                               "give a causal LM (e.g. a run's final/ or warmstart/) or a reward model")
    archs = list(getattr(AutoConfig.from_pretrained(path), "architectures", None) or [])
    if any(a.endswith("ForSequenceClassification") for a in archs):
        check_checkpoint(path, "--model")  # one scalar output, or a named error
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
        kind = "a reward model: its head trains on"
    else:
        try:
            model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
        except (ValueError, KeyError) as e:
            raise RewardModelError(f"--model {path!r}: transformers has no sequence-classification form of it "
                                   f"({str(e).splitlines()[0][:160]}); give a causal LM of a supported "
                                   "architecture") from None
        kind = f"{', '.join(archs) or 'a model'}: a new scalar head"
    tokenizer = AutoTokenizer.from_pretrained(path)
    set_pad_token(tokenizer, model)
    return model.to(device), tokenizer, kind


def _encoded(tokenizer: Any, pairs: list[PreferencePair], max_length: int) -> list[tuple[list[int], list[int]]]:
    out = []
    for p in pairs:
        prompt = prompt_text(tokenizer, p)
        out.append((encode(tokenizer, prompt, p.chosen, max_length), encode(tokenizer, prompt, p.rejected, max_length)))
    return out


def _pair_scores(model: Any, batch: list[tuple[list[int], list[int]]], pad_id: int, device: Any):
    """r(chosen), r(rejected) of a batch of encoded pairs, in one forward pass."""
    scores = sequence_scores(model, [c for c, _ in batch] + [r for _, r in batch], pad_id, device)
    n = len(batch)
    return scores[:n], scores[n:]


def evaluate(model: Any, data: list, pad_id: int, device: Any, batch_size: int, step: int) -> tuple[Evaluation, list[float]]:
    """Held-out BT loss and accuracy, and every completion's score."""
    import torch
    import torch.nn.functional as F
    model.eval()
    loss, right, scores = 0.0, 0, []
    with torch.inference_mode(), _autocast(device):
        for i in range(0, len(data), batch_size):
            rc, rr = _pair_scores(model, data[i:i + batch_size], pad_id, device)
            loss += float(-F.logsigmoid(rc - rr).sum())
            right += int((rc > rr).sum())
            scores += rc.tolist() + rr.tolist()
    model.train()
    return Evaluation(step, loss / len(data), right / len(data), len(data)), scores


def _autocast(device: Any):
    import contextlib

    import torch
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _device(name: str):
    import torch
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RewardModelError(f"--device {name}: this machine has no usable CUDA GPU; use --device cpu or auto")
    return torch.device(name)


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"--out {out}: exists and is not an empty directory; give a new directory")


def train_reward_model(cfg: RMTrainConfig, log: Callable[[str], None] = print) -> RMTrainResult:
    """- ``train_reward_model(cfg: RMTrainConfig, log) -> RMTrainResult`` reads and checks every pair
      first (``data.preferences.read_pairs``: a broken row is a ``DataError`` naming its line, and
      nothing is trained), loads ``cfg.model`` as a sequence classifier with one output (a causal
      LM gets a new scalar head; an existing reward model keeps its head; anything else is a
      ``RewardModelError``), and minimises ``-log sigmoid(r(chosen) - r(rejected))`` with AdamW on
      float32 weights (bf16 autocast on a GPU), ``batch_size`` pairs per optimizer step.
    - Held out: the pairs of ``cfg.eval_data``, or else a seeded ``eval_fraction`` of the prompts
      with all their pairs (so held-out accuracy is measured on prompts never trained on).
      Held-out loss and pair accuracy (the share of pairs whose chosen completion scores strictly
      higher) are measured before training, every ``eval_every`` steps and at the end, and passed
      to ``log`` as one line each.
    - Output: ``cfg.out`` (a new or empty directory) holds an HF checkpoint (weights, config with
      ``num_labels`` 1 and the pad id, tokenizer with a pad token) that ``reward.fn: rm`` loads,
      and ``model.STATS_FILE``: the final held-out numbers, the mean and std of the held-out
      completions' scores (``reward.normalize: standard``) and every evaluation.
    - Sequences are encoded by ``model.encode``, exactly as ``reward.fn: rm`` encodes a prompt and
      its completion during RL.
    """
    import torch
    import torch.nn.functional as F
    out = Path(cfg.out)
    _check_out(out)
    pairs = read_pairs(cfg.data)
    if cfg.eval_data:
        train, held = pairs, read_pairs(cfg.eval_data)
    else:
        train, held = split_pairs(pairs, cfg.eval_fraction, cfg.seed)
    device = _device(cfg.device)
    torch.manual_seed(cfg.seed)  # the new head's initialisation
    model, tokenizer, kind = load_base(cfg.model, device)
    pad_id = int(tokenizer.pad_token_id)
    max_length = cfg.max_length or context_length(model, tokenizer)
    train_enc, held_enc = _encoded(tokenizer, train, max_length), _encoded(tokenizer, held, max_length)
    per_epoch = math.ceil(len(train_enc) / cfg.batch_size)
    steps = cfg.steps or max(1, math.ceil(cfg.epochs * per_epoch))
    micro = min(cfg.micro_batch or cfg.batch_size, cfg.batch_size)
    log(f"train-rm: {len(train)} pairs to train on, {len(held)} held out"
        f"{'' if cfg.eval_data else ' (their prompts never trained on)'}; model {cfg.model} ({kind}) on {device}; "
        f"{steps} steps of {cfg.batch_size} pairs")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    first, _ = evaluate(model, held_enc, pad_id, device, cfg.batch_size, 0)
    history = [first]
    log(f"step 0/{steps}: held-out loss {first.loss:.4f}  accuracy {first.accuracy:.3f} ({first.pairs} pairs)")
    rng = random.Random(f"rm-{cfg.seed}")
    order: list[int] = []
    model.train()
    for step in range(1, steps + 1):
        batch = []
        while len(batch) < cfg.batch_size:  # epoch after epoch, each in a fresh seeded order
            if not order:
                order = rng.sample(range(len(train_enc)), len(train_enc))
            batch.append(train_enc[order.pop()])
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(0, len(batch), micro):
            with _autocast(device):
                rc, rr = _pair_scores(model, batch[i:i + micro], pad_id, device)
                loss = -F.logsigmoid(rc - rr).sum() / len(batch)
            loss.backward()
            total += float(loss.detach())
        if cfg.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        if (cfg.eval_every and step % cfg.eval_every == 0) and step < steps:
            ev, _ = evaluate(model, held_enc, pad_id, device, cfg.batch_size, step)
            history.append(ev)
            log(f"step {step}/{steps}: train loss {total:.4f}  held-out loss {ev.loss:.4f}  accuracy {ev.accuracy:.3f}")
    final, scores = evaluate(model, held_enc, pad_id, device, cfg.batch_size, steps)
    history.append(final)
    mean = sum(scores) / len(scores)
    std = math.sqrt(sum((s - mean) ** 2 for s in scores) / len(scores))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    result = RMTrainResult(out, steps, len(train), len(held), final, mean, std, history)
    (out / STATS_FILE).write_text(json.dumps({
        "base": cfg.model, "data": cfg.data, "eval_data": cfg.eval_data, "steps": steps,
        "train_pairs": len(train), "heldout_pairs": len(held), "heldout_loss": final.loss,
        "heldout_accuracy": final.accuracy, "score_mean": mean, "score_std": std,
        "max_length": max_length, "history": [asdict(e) for e in history]}, indent=1))
    log(f"final (step {steps}): held-out loss {final.loss:.4f}  accuracy {final.accuracy:.3f} "
        f"({final.pairs} pairs); held-out scores mean {mean:.3f} std {std:.3f}")
    return result
