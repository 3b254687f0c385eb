"""Resumable trainer checkpoints and plain Hugging Face exports.

Contract: ``save_checkpoint(trainer, dir, extra)`` writes ``policy/`` (HF
weights and tokenizer files), ``critic.safetensors``, ``training_state.pt``,
``rng.pt`` and ``extra.json`` atomically (a crash never leaves half a
checkpoint); ``save_checkpoint_async`` writes the same files on a thread from
host copies taken at the call (``PendingSave.wait()`` joins it).
``load_checkpoint(trainer, dir) -> extra`` restores it in place; the frozen
reference is not saved. ``reader_of(dir)``: ``fsdp`` for a sharded checkpoint,
``replicate`` for a whole one. ``export_hf(dir, out)`` writes a plain HF
checkpoint, also from a sharded one, in one process; ``export_policy(trainer,
out)`` the current policy. The trainer is duck-typed (``model``, ``critic``,
``source_dir``, ``training_state()``, ``load_training_state(state)``).

It knows nothing of what the extra state means, nor anything about training.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

# Files a tokenizer may consist of; copied next to the weights so that an
# exported directory is usable without the original checkpoint.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
    "chat_template.jinja", "chat_template.json",
)


# Marks a sharded (FSDP) checkpoint directory; its content names the format.
SHARDED_MARKER = "fsdp.json"


def reader_of(path: str | Path) -> str:
    """``fsdp`` for a sharded checkpoint, ``replicate`` for a whole one."""
    return "fsdp" if (Path(path) / SHARDED_MARKER).is_file() else "replicate"


def _prepare_tmp(final: str | Path) -> Path:
    """Create the empty temporary sibling that ``_commit`` later renames to ``final``."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


@contextlib.contextmanager
def _atomic_dir(final: str | Path) -> Iterator[Path]:
    tmp = _prepare_tmp(final)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _commit(tmp, final)


def _commit(tmp: Path, final: str | Path) -> None:
    """Rename ``tmp`` to ``final``, replacing (and then deleting) an older ``final``."""
    final = Path(final)
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
    tmp.rename(final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def copy_tokenizer_files(src: Path | None, dst: Path) -> list[str]:
    """Copy the tokenizer files present in ``src`` to ``dst``; returns their names."""
    if src is None or not Path(src).is_dir():
        return []
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, dst / name)
            copied.append(name)
    return copied


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is optional
        return state
    name, keys, pos, has_gauss, cached = np.random.get_state()
    # As a tensor so the file loads with torch.load(weights_only=True).
    state["numpy"] = (name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached)
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:  # pragma: no cover
            return
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))


def _extra_text(extra: dict[str, Any]) -> str:
    try:
        return json.dumps(extra, indent=2, sort_keys=True)
    except TypeError as e:
        raise TypeError(f"checkpoint extra must be JSON-serialisable ({e}); pass plain numbers/strings/lists") from None


class PendingSave:
    """A checkpoint being written on a thread; ``wait()`` blocks until it is in place and
    re-raises what went wrong writing it."""

    def __init__(self, path: Path, write: Callable[[], None]):
        self.path = path
        self._error: BaseException | None = None

        def run() -> None:
            try:
                write()
            except BaseException as e:  # noqa: BLE001 - re-raised by wait(), in the trainer's thread
                self._error = e
        self._thread = threading.Thread(target=run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def wait(self) -> Path:
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"writing checkpoint {self.path} failed: {self._error}") from self._error
        return self.path


def save_checkpoint_async(trainer: Any, path: str | Path, extra: dict[str, Any]) -> PendingSave:
    """``save_checkpoint`` with the files written on a thread: the weights are copied to host
    memory and the optimizer state serialised in memory here (the trainer may step right after),
    the disk writes and the atomic rename happen in the background. A trainer with a critic
    saves synchronously (returned already complete)."""
    path, extra_text = Path(path), _extra_text(extra)
    if trainer.critic is not None:
        save_checkpoint(trainer, path, extra)
        return PendingSave(path, lambda: None)
    copies: dict[tuple, torch.Tensor] = {}  # tied tensors stay one tensor, as save_pretrained expects
    state = {}
    for name, t in trainer.model.state_dict().items():
        key = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        if key not in copies:
            copies[key] = t.detach().to("cpu", copy=True)
        state[name] = copies[key]
    blobs = {}
    for fname, obj in (("training_state.pt", trainer.training_state()), ("rng.pt", _rng_state())):
        buf = io.BytesIO()
        torch.save(obj, buf)
        blobs[fname] = buf.getvalue()
    tmp = _prepare_tmp(path)
    model, source = trainer.model, trainer.source_dir

    def write() -> None:
        try:
            model.save_pretrained(tmp / "policy", state_dict=state)
            copy_tokenizer_files(source, tmp / "policy")
            for fname, data in blobs.items():
                (tmp / fname).write_bytes(data)
            (tmp / "extra.json").write_text(extra_text)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _commit(tmp, path)
    return PendingSave(path, write)


def save_checkpoint(trainer: Any, path: str | Path, extra: dict[str, Any]) -> Path:
    """Write a resumable checkpoint of ``trainer`` to ``path`` (atomically); returns ``path``.

    ::

        path/policy/               save_pretrained (safetensors) + tokenizer files of trainer.source_dir
        path/critic.safetensors    the critic (backbone + value head), if any
        path/training_state.pt     trainer.training_state(): optimizers, LR schedulers, step
        path/rng.pt                python random, numpy (if installed), torch CPU and CUDA RNG
        path/extra.json            ``extra`` (the loop's data cursor, step, ...)

    Assembled under a temporary sibling and renamed into place; an older ``path`` is moved aside
    first and deleted after the rename (the only window without a checkpoint there is between
    the two renames).
    """
    extra_text = _extra_text(extra)
    with _atomic_dir(path) as tmp:
        trainer.model.save_pretrained(tmp / "policy")
        copy_tokenizer_files(trainer.source_dir, tmp / "policy")
        if trainer.critic is not None:
            from safetensors.torch import save_model

            save_model(trainer.critic, str(tmp / "critic.safetensors"))
        torch.save(trainer.training_state(), tmp / "training_state.pt")
        torch.save(_rng_state(), tmp / "rng.pt")
        (tmp / "extra.json").write_text(extra_text)
    return Path(path)


def _read_policy_tensors(policy_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = policy_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        if not (policy_dir / name).is_file():
            raise FileNotFoundError(f"checkpoint policy file {policy_dir / name} is missing; the checkpoint is incomplete")
        state.update(load_file(str(policy_dir / name)))
    return state


def _key_mismatch(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> list[str]:
    own = model.state_dict()
    # Tied weights (e.g. lm_head = embed_tokens) are saved once; a missing
    # name is fine when it shares storage with a name that is present.
    loaded_ptrs = {own[k].data_ptr() for k in state if k in own}
    missing = [k for k in own if k not in state and own[k].data_ptr() not in loaded_ptrs]
    unexpected = [k for k in state if k not in own]
    return missing + unexpected


def load_policy_weights(model: torch.nn.Module, policy_dir: str | Path) -> None:
    """Copy the weights saved in ``policy_dir`` into ``model`` in place."""
    policy_dir = Path(policy_dir)
    state = _read_policy_tensors(policy_dir)
    if _key_mismatch(model, state):
        # Some architectures rename or fuse tensors on save; from_pretrained
        # knows how to undo that, at the cost of a temporary second copy.
        from transformers import AutoModelForCausalLM

        state = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32).state_dict()
        bad = _key_mismatch(model, state)
        if bad:
            raise ValueError(f"checkpoint {policy_dir} does not match the trainer's model "
                             f"(e.g. {bad[:3]}); resume with the same model architecture")
    model.load_state_dict(state, strict=False)


def load_checkpoint(trainer: Any, path: str | Path) -> dict[str, Any]:
    """Restore weights, optimizer/scheduler/step and RNG state; returns the saved ``extra``.

    In place: parameters keep their identity, so optimizer references stay valid. The frozen
    reference is not saved (it is what the trainer was built from): resume from the same initial
    model, not from ``path/policy``. A sharded checkpoint is refused.
    """
    path = Path(path)
    if (path / SHARDED_MARKER).is_file():
        raise ValueError(f"{path} is a sharded (FSDP) checkpoint; resume it with the FSDP trainer, "
                         "or turn it into a plain HF checkpoint with `conveyor export` first")
    if not (path / "policy").is_dir() or not (path / "training_state.pt").is_file():
        raise FileNotFoundError(f"{path} is not a conveyor checkpoint (needs policy/ and training_state.pt); "
                                "pass a directory written by save_checkpoint")
    load_policy_weights(trainer.model, path / "policy")
    critic_file = path / "critic.safetensors"
    if trainer.critic is not None:
        if not critic_file.is_file():
            raise FileNotFoundError(f"{critic_file} is missing but the trainer has a critic; set trainer.critic=false "
                                    "or resume from a checkpoint saved with a critic")
        from safetensors.torch import load_model

        load_model(trainer.critic, str(critic_file))
    trainer.load_training_state(torch.load(path / "training_state.pt", weights_only=True))
    _set_rng_state(torch.load(path / "rng.pt", weights_only=True))
    return json.loads((path / "extra.json").read_text())


def save_hf_weights(state: dict[str, torch.Tensor], out_dir: Path) -> None:
    """Write a full state dict as HF safetensors (sharded with an index past 5 GB)."""
    from huggingface_hub import save_torch_state_dict

    # A tensor viewing part of a larger buffer (e.g. an all-gathered, padded
    # shard) is refused by safetensors as possibly shared; give it its own storage.
    state = {k: v if v.untyped_storage().nbytes() == v.nbytes else v.clone() for k, v in state.items()}
    save_torch_state_dict(state, out_dir)


def read_sharded_policy(path: str | Path) -> dict[str, torch.Tensor]:
    """Full policy tensors of a sharded checkpoint, on CPU, in this process (no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(Path(path) / "dcp"))
    # Allocating from the metadata reads only the "model" entries; the
    # optimizer state (twice the weights for AdamW) is never touched.
    prefix = "model."
    state = {key[len(prefix):]: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in reader.read_metadata().state_dict_metadata.items()
             if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
    if not state:
        raise ValueError(f"{path}/dcp holds no policy weights; the sharded checkpoint is incomplete")
    dcp.load({"model": state}, storage_reader=reader, no_dist=True)
    return state


def export_hf(path: str | Path, out: str | Path) -> Path:
    """Write ``path``'s policy (weights, config, tokenizer files) to ``out`` as a plain HF checkpoint.

    A sharded checkpoint (``FSDPTrainer.save``: ``path/fsdp.json``, ``SHARDED_MARKER``; weights in
    ``path/dcp`` by torch.distributed.checkpoint, config and tokenizer in ``path/policy``) is read
    in this process without a process group, the policy weights only (no optimizer state).
    """
    policy = Path(path) / "policy"
    if not policy.is_dir():
        raise FileNotFoundError(f"{policy} does not exist; pass a checkpoint directory written by save_checkpoint")
    sharded = (Path(path) / SHARDED_MARKER).is_file()
    state = read_sharded_policy(path) if sharded else None
    with _atomic_dir(out) as tmp:
        for item in policy.iterdir():
            if item.is_file():
                shutil.copy2(item, tmp / item.name)
        if state is not None:
            save_hf_weights(state, tmp)
    return Path(out)


def export_policy(trainer: Any, out: str | Path) -> Path:
    """Write the trainer's current policy (and tokenizer files, if known) to ``out``."""
    with _atomic_dir(out) as tmp:
        trainer.model.save_pretrained(tmp)
        copy_tokenizer_files(trainer.source_dir, tmp)
    return Path(out)
