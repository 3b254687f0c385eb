"""Task sources read from files and Hugging Face datasets.

Contract: ``load_file_source(cfg, tokenizer, split)`` returns a ``ListSource``
for ``cfg.source``: ``jsonl``, ``parquet``, ``hf`` (a saved dataset, a local
file or directory, or a hub name) or ``gsm8k`` (gold answer after the last
``####``). Each row becomes ``Task(id="<split>-<row>", prompt, answer, info)``
with ``cfg.prompt_template`` and, if ``cfg.chat_template``, the tokenizer's
chat template applied. Invalid rows raise ``DataError`` naming file, 1-based
row and field, or with ``cfg.skip_invalid`` are skipped and counted. The eval
split is ``cfg.eval_path`` / ``cfg.eval_split`` when set, else a
deterministic holdout of ``cfg.eval_size`` rows removed from train. Every
source's default reward is ``"math"``; set ``reward.fn`` for another.

It does not know about batching or shuffling (``api.TaskCursor``), synthetic
tasks, or what any reward computes.
"""
from __future__ import annotations

import json
import logging
import random
import string
from pathlib import Path
from typing import Any, Iterable, Iterator

from conveyor.config import DataConfig
from conveyor.data.api import DataError, ListSource
from conveyor.types import Task

logger = logging.getLogger(__name__)

FILE_SOURCES = ("jsonl", "parquet", "hf", "gsm8k")
_HF_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
_GSM8K_HUB = ("openai/gsm8k", "main")

Row = tuple[int, "dict[str, Any] | str"]  # (1-based row number, the row or why it is unreadable)


class _RowError(Exception):
    """One row cannot become a task; the message says which field and why."""


def load_file_source(cfg: DataConfig, tokenizer: Any = None, split: str = "train") -> ListSource:
    """The ``split`` ("train" or "eval") of ``cfg.source`` as a ``ListSource``.

    - ``jsonl``: one JSON object per line (blank lines ignored; row numbers are line numbers).
      ``parquet``: needs pyarrow (the ``conveyor[data]`` extra). ``hf``: a ``save_to_disk``
      directory, a local .jsonl/.json/.parquet/.csv file (its only split is "train"), a local
      dataset directory, or a hub name loaded with ``datasets.load_dataset(path,
      options["hf_config"], split=...)``. ``gsm8k``: ``{"question", "answer": "...#### 42"}`` rows
      from a jsonl or parquet file or a dataset (default ``openai/gsm8k``, config ``main``); the
      gold answer is the text after the last ``####`` without thousands separators, the full
      solution kept in ``info["solution"]``.
    - A row's prompt is ``cfg.prompt_template.format(prompt=row[prompt_field], **row)``, then with
      ``cfg.chat_template`` the tokenizer's chat template (optional system message, generation
      prompt). ``info`` holds the row's other fields, ``row`` (1-based) and ``raw_prompt``;
      ``answer_field=""`` means rows carry no gold answer (e.g. for a reward model).
    - Invalid rows (missing field, empty or non-string prompt, malformed JSON) raise
      ``DataError`` naming file, row and field, or with ``cfg.skip_invalid`` are counted in
      ``stats["skipped"]`` and reported in one warning. No valid row at all is always an error.
    - Eval: ``cfg.eval_path`` and/or ``cfg.eval_split`` (default "test" when only eval_path is
      given), else a deterministic holdout of ``cfg.eval_size`` rows drawn with ``cfg.seed`` and
      REMOVED from train: "train" and "eval" loaded separately are complementary.
      ``eval_size=0`` without an eval path gives an empty eval source.
    """
    if split not in ("train", "eval"):
        raise DataError(f"load_file_source split={split!r} must be 'train' or 'eval'")
    if cfg.source not in FILE_SOURCES:
        raise DataError(f"data.source={cfg.source!r} is not a file source ({', '.join(FILE_SOURCES)}); "
                        "synthetic:<name> sources are built by conveyor.data.synthetic")
    _check_rendering(cfg, tokenizer)
    _check_eval_split(cfg)
    separate_eval = bool(cfg.eval_path or cfg.eval_split)
    if split == "eval" and separate_eval:
        path = cfg.eval_path or cfg.path
        hf_split = cfg.eval_split or "test"
        return _load(cfg, tokenizer, path, hf_split, id_prefix="eval")
    source = _load(cfg, tokenizer, cfg.path, cfg.split, id_prefix="train")
    if separate_eval:
        return source
    held = holdout_indices(len(source), cfg.eval_size, cfg.seed, source.name)
    source.stats["held_out"] = len(held)
    if split == "eval":
        source.tasks = [source.tasks[i] for i in sorted(held)]
    else:
        source.tasks = [t for i, t in enumerate(source.tasks) if i not in held]
    return source


def _check_eval_split(cfg: DataConfig) -> None:
    """An eval split that would silently equal the train rows is refused."""
    if not cfg.eval_split or (cfg.eval_path and cfg.eval_path != cfg.path):
        return
    if _resolve_kind(cfg, cfg.path)[0] != "hf":
        raise DataError("data.eval_split only selects a split of a Hugging Face dataset; for a "
                        "jsonl/parquet file give data.eval_path (or neither, for a holdout)")
    if cfg.eval_split == cfg.split:
        raise DataError(f"data.eval_split={cfg.eval_split!r} equals data.split: eval would reuse the "
                        "training rows; choose another split, or unset it for a holdout")


def holdout_indices(n: int, eval_size: int, seed: int, origin: str = "data") -> set[int]:
    """Indices (into the valid rows) of the eval holdout; the same for the same arguments."""
    if eval_size == 0:
        return set()
    if eval_size >= n:
        raise DataError(f"{origin}: data.eval_size={eval_size} would hold out all {n} valid rows; "
                        "lower data.eval_size or give data.eval_path / data.eval_split")
    # String seeds are hashed with SHA-512: the same holdout in every process.
    return set(random.Random(f"conveyor-holdout:{seed}").sample(range(n), eval_size))


# ---- reading rows -------------------------------------------------------------


def _load(cfg: DataConfig, tokenizer: Any, path: str | None, hf_split: str, id_prefix: str) -> ListSource:
    kind, path, hf_config = _resolve_kind(cfg, path)
    if kind == "jsonl":
        rows, origin = _read_jsonl(path), path
    elif kind == "parquet":
        rows, origin = _read_parquet(path), path
    else:
        rows, origin = _read_hf(path, hf_split, hf_config), f"{path} [{hf_split}]"
    gsm8k = cfg.source == "gsm8k"
    prompt_field = cfg.prompt_field
    if gsm8k and "prompt_field" not in cfg.model_fields_set:
        prompt_field = "question"  # GSM8K's own field name unless the recipe chose one
    tasks, stats = _build_tasks(rows, cfg, tokenizer, origin, prompt_field, gsm8k, id_prefix)
    return ListSource(tasks, default_reward="math", stats=stats, name=origin)


def _resolve_kind(cfg: DataConfig, path: str | None) -> tuple[str, str, str | None]:
    """(reader, path, hf config name) for a source and path."""
    hf_config = cfg.options.get("hf_config")
    if cfg.source == "gsm8k":
        if not path:
            return "hf", _GSM8K_HUB[0], hf_config or _GSM8K_HUB[1]
        suffix = Path(path).suffix.lower()
        kind = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}.get(suffix, "hf")
        return kind, path, hf_config
    if not path:
        raise DataError(f"data.source={cfg.source!r} needs data.path (a file path or dataset name)")
    return cfg.source, path, hf_config


def _require_file(path: str) -> None:
    if not Path(path).is_file():
        raise DataError(f"data file {path} does not exist; check data.path / data.eval_path")


def text_lines(path: str | Path) -> Iterator[tuple[int, str | None, str]]:
    """``(n, text, "")`` for every line of a UTF-8 text file (n 1-based; a byte-order mark before
    the first line is dropped); a line that is not UTF-8 is ``(n, None, what is wrong)``, so the
    reader names that row or skips it instead of failing the whole file."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                yield n, raw.decode("utf-8-sig" if n == 1 else "utf-8"), ""
            except UnicodeDecodeError as e:
                yield n, None, (f"is not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the "
                                "line); save the file as UTF-8")


def _read_jsonl(path: str) -> Iterator[Row]:
    _require_file(path)
    for n, line, problem in text_lines(path):
        if line is None:
            yield n, problem
            continue
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            yield n, f"is not valid JSON ({e.msg} at column {e.colno})"
            continue
        yield n, row if isinstance(row, dict) else f"is a JSON {type(row).__name__}, not an object"


def _read_parquet(path: str) -> Iterator[Row]:
    _require_file(path)
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("data.source parquet needs pyarrow: pip install 'conveyor[data]'") from None
    import pyarrow as pa
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as e:  # truncated, or not Parquet at all
        raise DataError(f"{path} is not a readable Parquet file ({type(e).__name__}: {e}); "
                        "write it again, or point data.path at the right file") from None
    yield from enumerate(table.to_pylist(), start=1)


def _read_hf(path: str, split: str, hf_config: str | None) -> Iterator[Row]:
    try:
        import datasets
    except ImportError:
        raise DataError("Hugging Face data sources need the `datasets` package: "
                        "pip install 'conveyor[data]'") from None
    p = Path(path)
    try:
        if p.is_dir() and any((p / f).is_file() for f in ("state.json", "dataset_dict.json")):
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise DataError(f"dataset {path} has no split {split!r} (it has {', '.join(ds)}); "
                                    "set data.split / data.eval_split")
                ds = ds[split]
        elif p.is_file():
            builder = _HF_FILE_BUILDERS.get(p.suffix.lower())
            if builder is None:
                raise DataError(f"data file {path} has an unknown type; use one of "
                                f"{', '.join(_HF_FILE_BUILDERS)}")
            ds = datasets.load_dataset(builder, data_files=str(p), split="train")
        else:
            ds = datasets.load_dataset(path, hf_config, split=split)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets raises many types; all mean "cannot load"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(f"cannot load Hugging Face dataset {path!r} split {split!r}: {first}") from None
    yield from enumerate(ds, start=1)


# ---- rows to tasks ------------------------------------------------------------


def _check_rendering(cfg: DataConfig, tokenizer: Any) -> None:
    """Problems with the template or tokenizer concern every row, so they fail before reading."""
    try:
        names = [f for _, f, _, _ in string.Formatter().parse(cfg.prompt_template) if f is not None]
    except ValueError as e:
        raise DataError(f"data.prompt_template is malformed ({e}); write literal braces as {{{{ and }}}}") from None
    if any(n == "" or n.isdigit() for n in names):
        raise DataError("data.prompt_template uses a positional field {}; name it, e.g. {prompt}, "
                        "and write literal braces as {{ and }}")
    if cfg.system_prompt and not cfg.chat_template:
        raise DataError("data.system_prompt needs data.chat_template=true (a system message only exists "
                        "in a chat template)")
    if cfg.chat_template:
        if tokenizer is None:
            raise DataError("data.chat_template=true but no tokenizer was given to load_file_source")
        if not getattr(tokenizer, "chat_template", None):
            raise DataError("data.chat_template=true but the tokenizer has no chat template; set "
                            "data.chat_template=false or use a tokenizer (chat/instruct model) that has one")


def _build_tasks(rows: Iterable[Row], cfg: DataConfig, tokenizer: Any, origin: str, prompt_field: str,
                 gsm8k: bool, id_prefix: str) -> tuple[list[Task], dict[str, int]]:
    tasks: list[Task] = []
    total = skipped = 0
    first_problem = ""
    for n, row in rows:
        total += 1
        try:
            tasks.append(_row_to_task(n, row, cfg, tokenizer, prompt_field, gsm8k, id_prefix))
        except _RowError as e:
            problem = f"{origin} row {n}: {e}"
            if not cfg.skip_invalid:
                raise DataError(f"{problem}; fix the row or set data.skip_invalid=true") from None
            skipped += 1
            first_problem = first_problem or problem
    if skipped:
        logger.warning("%s: skipped %d invalid rows of %d (first: %s)", origin, skipped, total, first_problem)
    if not tasks:
        raise DataError(f"{origin}: no valid rows ({total} read, {skipped} skipped); check the file and "
                        "data.prompt_field / data.answer_field")
    return tasks, {"rows": total, "skipped": skipped}


def _row_to_task(n: int, row: dict[str, Any] | str, cfg: DataConfig, tokenizer: Any, prompt_field: str,
                 gsm8k: bool, id_prefix: str) -> Task:
    if isinstance(row, str):
        raise _RowError(row)
    prompt = row.get(prompt_field)
    if prompt is None:
        raise _RowError(f"missing field {prompt_field!r} (data.prompt_field)")
    if not isinstance(prompt, str) or not prompt.strip():
        raise _RowError(f"field {prompt_field!r} must be a non-empty string, got {_short(prompt)}")
    answer, info = None, {k: v for k, v in row.items() if k not in (prompt_field, cfg.answer_field)}
    if cfg.answer_field:
        answer = _answer(row, cfg.answer_field, gsm8k)
        if gsm8k:
            info["solution"] = row[cfg.answer_field]
    try:
        text = cfg.prompt_template.format_map({**row, "prompt": prompt})
    except KeyError as e:
        raise _RowError(f"data.prompt_template names field {e} that the row does not have") from None
    info.update(row=n, raw_prompt=prompt)
    return Task(id=f"{id_prefix}-{n}", prompt=chat_prompt(cfg, tokenizer, text), answer=answer, info=info)


def check_tokenizer(tokenizer: Any, name: str, chat: bool) -> None:
    """An end-of-turn token and, with ``chat``, a chat template that renders; else ``ValueError``
    naming ``name`` and the fix (raised before a run starts, not at its first prompt)."""
    if tokenizer.eos_token_id is None:
        raise ValueError(f"{name}: the tokenizer has no end-of-turn (EOS) token, so completions could never "
                         "stop; use a model whose tokenizer defines one")
    if not chat:
        return
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{name}: the tokenizer has no chat template; set data.chat_template=false "
                         "(prompts as plain text) or use an instruct model")
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "1 + 1?"}], tokenize=False,
                                      add_generation_prompt=True)
    except Exception as e:  # a template is a Jinja program: any of its errors means it cannot be used
        first = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(f"{name}: the chat template does not render ({type(e).__name__}: {first}); "
                         "fix the template or set data.chat_template=false") from None


def chat_prompt(cfg: DataConfig, tokenizer: Any, text: str) -> str:
    """``text`` (already through ``data.prompt_template``) as the model sees it: with
    ``data.chat_template`` a user message (after ``data.system_prompt``) rendered by the
    tokenizer's chat template, ready for the assistant's turn; else unchanged."""
    if not cfg.chat_template:
        return text
    messages = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    messages.append({"role": "user", "content": text})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _answer(row: dict[str, Any], field: str, gsm8k: bool) -> str:
    value = row.get(field)
    if value is None:
        raise _RowError(f"missing field {field!r} (data.answer_field)")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise _RowError(f"field {field!r} must be a string or number, got {_short(value)}")
    answer = str(value)
    if gsm8k:
        if "####" not in answer:
            raise _RowError(f"field {field!r} has no '#### <final answer>' (GSM8K format)")
        # Thousands separators are formatting, not part of the number.
        answer = answer.rsplit("####", 1)[1].strip().replace(",", "")
    if not answer.strip():
        raise _RowError(f"field {field!r} is empty")
    return answer


def _short(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"
