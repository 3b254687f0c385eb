"""A reward model: a Hugging Face sequence-classification checkpoint with one output, as a
batched reward (``reward.fn: rm``).

- ``RewardModel(path, device, max_batch, normalize)`` is an ``api.BatchReward`` scoring each
  trajectory's prompt and completion as ``encode`` does (the encoding ``train_rm`` trains on).
- ``check_checkpoint(path)`` refuses, with a ``RewardModelError`` naming the checkpoint and the
  fix, what is not a one-output sequence classifier; ``RewardModel`` runs it first.
- Forward passes run one at a time.

It knows nothing of the service's threads and deadlines (``service.py``), of where the
trainer runs (the controller passes the device) or of how a model was trained.
"""
from __future__ import annotations

import json
import math
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from conveyor.types import Trajectory

STATS_FILE = "conveyor_rm.json"  # train_rm's record beside the weights: held-out numbers, score mean/std
NORMALIZE = ("none", "sigmoid", "standard")


class RewardModelError(ValueError):
    """A reward model checkpoint that cannot be used; the message names it and the fix."""


def check_checkpoint(path: str | Path, what: str = "reward.model") -> Any:
    """The checkpoint's HF config, if it is a sequence classifier with one output.

    ``check_checkpoint(path)`` refuses, with a ``RewardModelError`` naming the checkpoint and the
    fix, a directory without a config, a model that is not a sequence classifier (a causal LM
    would get a randomly initialised head) and a head of more than one output (``num_labels``
    != 1). ``RewardModel`` runs it before loading anything.
    """
    from transformers import AutoConfig
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise RewardModelError(f"{what} {str(path)!r} is not a Hugging Face checkpoint directory (no config.json); "
                               "give a directory written by conveyor train-rm or save_pretrained")
    try:
        config = AutoConfig.from_pretrained(str(p))
    except (OSError, ValueError, KeyError) as e:
        raise RewardModelError(f"{what} {str(path)!r}: its config.json cannot be read "
                               f"({str(e).splitlines()[0]})") from None
    archs = list(getattr(config, "architectures", None) or [])
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise RewardModelError(f"{what} {str(path)!r} is a {', '.join(archs) or config.model_type} model, not a "
                               "sequence classifier with a scalar head; train one from it with "
                               f"`conveyor train-rm PAIRS.jsonl --model {path} --out DIR`")
    if config.num_labels != 1:
        raise RewardModelError(f"{what} {str(path)!r} has {config.num_labels} outputs (num_labels="
                               f"{config.num_labels}); a reward model has one scalar output: train one with "
                               f"`conveyor train-rm PAIRS.jsonl --model {path} --out DIR`")
    return config


def encode(tokenizer: Any, prompt: str, completion: str, max_length: int) -> list[int]:
    """The token ids a reward model scores for ``prompt`` + ``completion``.

    ``encode(tokenizer, prompt, completion, max_length)``: prompt tokens (the tokenizer's special
    tokens added unless the prompt already starts with its BOS text), completion tokens and EOS;
    a sequence longer than ``max_length`` loses tokens from its left end, so the completion and
    the EOS that the head reads are kept.
    """
    special = not (tokenizer.bos_token and prompt.startswith(tokenizer.bos_token))
    ids = tokenizer(prompt, add_special_tokens=special)["input_ids"]
    ids = ids + tokenizer(completion, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return ids[-max_length:]


def context_length(model: Any, tokenizer: Any) -> int:
    """The longest sequence the model takes: its position table, or the tokenizer's limit."""
    limits = [getattr(model.config, "max_position_embeddings", None), getattr(tokenizer, "model_max_length", None)]
    usable = [int(x) for x in limits if isinstance(x, int) and 0 < x < 10 ** 7]
    return min(usable) if usable else 2048


def set_pad_token(tokenizer: Any, model: Any) -> int:
    """A pad id for batches (the tokenizer's pad, else its EOS), recorded in the model's config,
    which is where a sequence classifier finds each sequence's last token."""
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise RewardModelError("the reward model's tokenizer has neither a pad nor an EOS token; "
                                   "set tokenizer.pad_token and save it with the checkpoint")
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    return int(tokenizer.pad_token_id)


def sequence_scores(model: Any, seqs: Sequence[Sequence[int]], pad_id: int, device: Any):
    """The scalar head's output for each sequence (right-padded into one batch), float32 ``[B]``."""
    import torch
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(list(s), dtype=torch.long)
        mask[i, :len(s)] = 1
    out = model(input_ids=ids.to(device), attention_mask=mask.to(device))
    return out.logits[:, 0].float()


def read_stats(path: str | Path) -> dict[str, Any]:
    f = Path(path).expanduser() / STATS_FILE
    return json.loads(f.read_text()) if f.is_file() else {}


class RewardModel:
    """``reward.fn: rm``: a sequence classifier's score of each trajectory.

    ``RewardModel(path, device, max_batch, normalize)`` is an ``api.BatchReward``.
    ``score_batch(trajs)`` scores each trajectory's prompt (``task.prompt``: the text the policy
    saw, the data section's templates already applied) followed by its completion text, through
    the reward model's own tokenizer, ``encode``'s way (the same encoding ``train_rm`` trains
    on), in padded batches of up to ``max_batch``, and returns the scalar head's output:
    ``normalize`` "none" as is (a float); "sigmoid" in (0, 1); "standard" ``(score - mean) / std``
    with the mean and std of scores ``train_rm`` measured on its held-out completions (read from
    ``STATS_FILE`` in the checkpoint). Normalised results are dicts that keep the raw score as
    ``rm_score`` (logged as a metric).
    - Forward passes run one at a time (a lock): a model on one device is no faster with two
      batches at once, and one batch's activations bound the memory it takes beside the trainer.
      ``close()`` drops the model (and, on a GPU, its cached memory).
    """

    def __init__(self, path: str | Path, device: str = "cpu", max_batch: int = 32, normalize: str = "none") -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        if normalize not in NORMALIZE:
            raise RewardModelError(f"reward.normalize={normalize!r}; choose one of {', '.join(NORMALIZE)}")
        check_checkpoint(path)
        self.path, self.name, self.max_batch, self.normalize = str(path), "rm", int(max_batch), normalize
        self.mean, self.std = 0.0, 1.0
        if normalize == "standard":
            stats = read_stats(path)
            if not {"score_mean", "score_std"} <= set(stats) or not stats["score_std"] > 0:
                raise RewardModelError(f"reward.normalize=standard needs the score mean and std that conveyor "
                                       f"train-rm records in {Path(path) / STATS_FILE}; that file is missing or "
                                       "incomplete: use reward.normalize=none or sigmoid")
            self.mean, self.std = float(stats["score_mean"]), float(stats["score_std"])
        self.device = torch.device(device)
        # float32 on CPU; on a GPU the checkpoint's own dtype (a bf16 reward model stays bf16).
        dtype = "auto" if self.device.type == "cuda" else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.model = AutoModelForSequenceClassification.from_pretrained(self.path, dtype=dtype).to(self.device)
        self.model.eval()
        self.pad_id = set_pad_token(self.tokenizer, self.model)
        self.max_length = context_length(self.model, self.tokenizer)
        self._lock = threading.Lock()
        with torch.inference_mode():  # a first call's one-off costs (CUDA context, kernels) before the deadline runs
            sequence_scores(self.model, [encode(self.tokenizer, "", "", self.max_length)], self.pad_id, self.device)

    def score_batch(self, trajs: Sequence[Trajectory]) -> list[float | dict]:
        import torch
        seqs = [encode(self.tokenizer, t.task.prompt, t.text, self.max_length) for t in trajs]
        raw: list[float] = []
        with self._lock, torch.inference_mode():
            if self.model is None:
                raise RuntimeError(f"reward model {self.path} is closed")
            for i in range(0, len(seqs), self.max_batch):
                raw += sequence_scores(self.model, seqs[i:i + self.max_batch], self.pad_id, self.device).tolist()
        return [self._result(r) for r in raw]

    def _result(self, score: float) -> float | dict:
        if self.normalize == "none":
            return score
        if self.normalize == "sigmoid":
            value = 1.0 / (1.0 + math.exp(-score)) if score >= 0 else math.exp(score) / (1.0 + math.exp(score))
        else:
            value = (score - self.mean) / self.std
        return {"reward": value, "rm_score": score}

    def close(self) -> None:
        with self._lock:
            if self.model is None:
                return
            self.model = None
        if self.device.type == "cuda":
            import torch
            torch.cuda.empty_cache()
