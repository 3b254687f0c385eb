"""Preference pairs: what a reward model is trained on (``conveyor train-rm``).

- ``read_pairs(path) -> list[PreferencePair]`` reads a JSONL file in one of three forms; every
  row is checked before any is used, and a broken one raises ``DataError`` naming ``path:line``
  and the fix (never skipped silently: a wrong label teaches the opposite).
- ``prompt_text(tokenizer, pair)``: the prompt as text (chat template applied to messages).
- ``synthetic_pairs`` / ``write_pairs``: pairs for the built-in synthetic tasks, from their
  training split only, as JSONL.

It knows nothing of models or training (``reward.train_rm``) or of how a reward is computed.
"""
from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conveyor.data.api import DataError
from conveyor.data.files import text_lines

Message = dict[str, str]


@dataclass(frozen=True)
class PreferencePair:
    """One comparison: ``chosen`` is preferred to ``rejected`` as a completion of ``prompt``
    (text, or a conversation to render); ``line`` is its 1-based line in the file."""
    prompt: str | tuple[Message, ...]
    chosen: str
    rejected: str
    line: int = 0


def read_pairs(path: str | Path) -> list[PreferencePair]:
    """``read_pairs(path) -> list[PreferencePair]`` reads a JSONL file, one pair per line (blank
    lines skipped), in one of three forms:
    * ``{"prompt": str, "chosen": str, "rejected": str}``: texts used as they are;
    * ``{"prompt": [messages], "chosen": ..., "rejected": ...}``: the prompt is a conversation
      (``{"role", "content"}`` dicts) rendered by the reward model's chat template with the
      assistant's turn opened; each completion is a string or a list of one assistant message;
    * ``{"chosen": [messages], "rejected": [messages]}``: two conversations that share every
      message but the last, an assistant message each; the shared part is the prompt.
    Every row is checked before any is used: a line that is not JSON or not an object, a
    missing or mistyped key, an empty completion, or ``chosen == rejected`` raises ``DataError``
    naming ``path:line`` and the fix. Broken rows are never skipped silently: a pair with a
    wrong label teaches the opposite of what it should.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"preference pairs {str(path)!r}: no such file; give a JSONL file of "
                        '{"prompt", "chosen", "rejected"} rows')
    pairs = []
    for n, line, problem in text_lines(p):
        if line is None:
            raise DataError(f"{path}:{n}: {problem}")
        if line.strip():
            pairs.append(_pair(line, f"{path}:{n}", n))
    if not pairs:
        raise DataError(f"preference pairs {str(path)!r} holds no rows; give one JSON object per line")
    return pairs


def _pair(line: str, where: str, n: int) -> PreferencePair:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); fix or remove the line") from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object with prompt, chosen and rejected; "
                        f"got a {type(row).__name__}")
    missing = [k for k in ("chosen", "rejected") if k not in row]
    if missing:
        raise DataError(f"{where}: missing {' and '.join(map(repr, missing))}; each row needs chosen and "
                        "rejected (and a prompt unless both are conversations)")
    if "prompt" in row:
        prompt: str | tuple[Message, ...] = _prompt(row["prompt"], where)
        chosen, rejected = _completion(row["chosen"], "chosen", where), _completion(row["rejected"], "rejected", where)
    else:
        prompt, chosen, rejected = _conversations(row["chosen"], row["rejected"], where)
    if chosen == rejected:
        raise DataError(f"{where}: chosen and rejected are the same text, which teaches nothing; "
                        "remove the row or fix one of them")
    return PreferencePair(prompt, chosen, rejected, n)


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def _prompt(v: Any, where: str) -> str | tuple[Message, ...]:
    if isinstance(v, str):
        return v
    if isinstance(v, list) and v and all(_is_message(m) for m in v):
        return tuple({"role": m["role"], "content": m["content"]} for m in v)
    raise DataError(f"{where}: 'prompt' must be a string or a non-empty list of {{role, content}} messages")


def _completion(v: Any, key: str, where: str) -> str:
    if isinstance(v, list) and len(v) == 1 and _is_message(v[0]) and v[0]["role"] == "assistant":
        v = v[0]["content"]
    if not isinstance(v, str):
        raise DataError(f"{where}: {key!r} must be a string or a list of one assistant message")
    if not v.strip():
        raise DataError(f"{where}: {key!r} is empty; remove the row or give the completion")
    return v


def _conversations(chosen: Any, rejected: Any, where: str) -> tuple[tuple[Message, ...], str, str]:
    for key, conv in (("chosen", chosen), ("rejected", rejected)):
        if not (isinstance(conv, list) and len(conv) >= 2 and all(_is_message(m) for m in conv)
                and conv[-1]["role"] == "assistant"):
            raise DataError(f"{where}: without 'prompt', {key!r} must be a conversation ({{role, content}} "
                            "messages) ending with an assistant message, after at least one other message")
    if chosen[:-1] != rejected[:-1]:
        raise DataError(f"{where}: chosen and rejected must share every message but the last (the prompt); "
                        "give the prompt separately if they differ")
    prompt = tuple({"role": m["role"], "content": m["content"]} for m in chosen[:-1])
    return prompt, _completion(chosen[-1:], "chosen", where), _completion(rejected[-1:], "rejected", where)


def prompt_text(tokenizer: Any, pair: PreferencePair) -> str:
    if isinstance(pair.prompt, str):
        return pair.prompt
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"line {pair.line}: a chat-style prompt needs a tokenizer with a chat template, and "
                        "the model's has none; give the prompt as text")
    return tokenizer.apply_chat_template(list(pair.prompt), tokenize=False, add_generation_prompt=True)


# ---- pairs for the built-in synthetic tasks ---------------------------------------------------


def _changed(answer: str, rng: random.Random, alphabet: str) -> str:
    """The answer with one slip: a character changed, dropped, added, or two swapped."""
    chars = list(answer)
    i = rng.randrange(len(chars))
    kind = rng.choice(("change", "change", "drop", "add", "swap") if len(chars) > 1 else ("change", "add"))
    if kind == "change":
        chars[i] = rng.choice([c for c in alphabet if c != chars[i]])
    elif kind == "drop":
        del chars[i]
    elif kind == "add":
        chars.insert(i, rng.choice(alphabet))
    else:
        j = rng.choice([k for k in range(len(chars)) if k != i])
        chars[i], chars[j] = chars[j], chars[i]
    return "".join(chars)


def synthetic_pairs(name: str, n: int, options: dict | None = None, eval_size: int = 256,
                    seed: int = 0) -> list[PreferencePair]:
    """``synthetic_pairs(name, n, options, eval_size, seed)``: pairs for the built-in synthetic
    tasks (``data.synthetic``), the gold answer chosen over a wrong one: a quarter the
    imperfect teacher's mistake, a quarter the answer up to some point and the mistake after
    it, half the answer with one slip (a character changed, dropped, added, or two swapped);
    from the training split of those tasks only, so a run's held-out tasks stay unseen. ``write_pairs(path, pairs)`` writes them as JSONL rows of the first form.
    """
    from conveyor.data.synthetic import synthetic_source
    if name not in ("addition", "reverse"):
        raise DataError(f"synthetic pairs exist for addition and reverse, not {name!r}")
    options = dict(options or {})
    options.setdefault("teacher_error", 1.0)  # its demonstration is then always the teacher's mistake
    source = synthetic_source(name, "train", options, eval_size, seed)
    alphabet = string.digits if name == "addition" else string.ascii_lowercase
    rng = random.Random(f"pairs-{name}-{seed}")
    pairs = []
    for i in rng.sample(range(len(source)), min(n, len(source))):
        task = source[i]
        answer = task.answer or ""
        mistake, u = source.demonstration(task, rng), rng.random()
        if u < 0.25:
            wrong = mistake
        elif u < 0.5 and len(answer) > 1:  # right up to some point, then the mistake
            k = rng.randrange(1, len(answer))
            wrong = answer[:k] + mistake[k:]
        else:
            wrong = _changed(answer, rng, alphabet)
        while wrong == answer:  # a palindrome's copy, a sum without carries, a splice of equal tails
            wrong = _changed(answer, rng, alphabet)
        pairs.append(PreferencePair(task.prompt, answer, wrong, len(pairs) + 1))
    return pairs


def write_pairs(path: str | Path, pairs: list[PreferencePair]) -> Path:
    p = Path(path)
    with p.open("w", encoding="utf-8") as f:
        for pair in pairs:
            prompt = pair.prompt if isinstance(pair.prompt, str) else list(pair.prompt)
            f.write(json.dumps({"prompt": prompt, "chosen": pair.chosen, "rejected": pair.rejected}) + "\n")
    return p
