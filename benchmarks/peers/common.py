"""What every peer does around its training run: read the spec, describe the machine, write result.json.

Contract: ``load_spec(path)`` returns the spec dict; ``write_result(run_dir,
result)`` writes ``result.json`` atomically; ``gpu_memory()`` reports the
peak CUDA memory of this process (empty on CPU). Nothing here trains.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

RESULT = "result.json"


def load_spec(path: str | Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def write_result(run_dir: str | Path, result: dict) -> Path:
    from conveyor.observe.report import json_safe
    path = Path(run_dir) / RESULT
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(json_safe(result), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def gpu_memory() -> dict:
    import torch
    if not torch.cuda.is_available():
        return {}
    return {"cuda_max_memory_allocated_gb": torch.cuda.max_memory_allocated() / 2 ** 30}


def spec_path_from_argv() -> str:
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: python -m {sys.modules['__main__'].__spec__.name} SPEC.json")
    return sys.argv[1]
