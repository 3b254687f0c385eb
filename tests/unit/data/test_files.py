"""File task sources: jsonl, parquet, Hugging Face datasets, GSM8K; errors and splits."""
import json
import logging
from pathlib import Path

import pytest

from conveyor.config import DataConfig
from conveyor.data.api import DataError, TaskSource
from conveyor.data.files import holdout_indices, load_file_source
from conveyor.data.tiny import build_tokenizer
from conveyor.reward.verifiers import math_reward
from conveyor.types import Trajectory

GSM8K_SAMPLE = Path(__file__).resolve().parents[2] / "data" / "gsm8k_sample.jsonl"
ROWS = [{"prompt": f"{i}+1=", "answer": str(i + 1), "level": i % 3} for i in range(6)]


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def cfg(**kw) -> DataConfig:
    return DataConfig(**{"eval_size": 0, **kw})


def test_jsonl_rows_become_tasks(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    src = load_file_source(cfg(source="jsonl", path=path, prompt_template="Q: {prompt}"))
    assert isinstance(src, TaskSource)
    assert len(src) == 6 and src.default_reward == "math"
    t = src[2]
    assert (t.id, t.prompt, t.answer) == ("train-3", "Q: 2+1=", "3")
    assert t.info == {"level": 2, "row": 3, "raw_prompt": "2+1="}
    assert src.stats == {"rows": 6, "skipped": 0, "held_out": 0}


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist([{"q": "2*3=", "a": 6}, {"q": "7-2=", "a": 5}]), path)
    src = load_file_source(cfg(source="parquet", path=str(path), prompt_field="q", answer_field="a"))
    assert [(t.prompt, t.answer) for t in src] == [("2*3=", "6"), ("7-2=", "5")]


def test_a_truncated_or_foreign_parquet_file_is_an_error_naming_it(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist([{"q": "2*3=", "a": 6}] * 50), path)
    whole = path.read_bytes()
    for data in (whole[: len(whole) // 2], b"not parquet at all\n"):
        path.write_bytes(data)
        with pytest.raises(DataError, match=f"{path} is not a readable Parquet file .*point data.path"):
            list(load_file_source(cfg(source="parquet", path=str(path), prompt_field="q", answer_field="a")))


def test_hf_save_to_disk_dataset_dict_and_dataset(tmp_path):
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:4]),
                               "test": datasets.Dataset.from_list(ROWS[4:])})
    dd.save_to_disk(str(tmp_path / "ds"))
    c = cfg(source="hf", path=str(tmp_path / "ds"), eval_split="test")
    train, ev = load_file_source(c), load_file_source(c, split="eval")
    assert [t.answer for t in train] == ["1", "2", "3", "4"]
    assert [(t.id, t.answer) for t in ev] == [("eval-1", "5"), ("eval-2", "6")]
    with pytest.raises(DataError, match=r"has no split 'valid' \(it has train, test\)"):
        load_file_source(cfg(source="hf", path=str(tmp_path / "ds"), split="valid"))

    one = tmp_path / "one"
    datasets.Dataset.from_list(ROWS[:2]).save_to_disk(str(one))
    assert [t.prompt for t in load_file_source(cfg(source="hf", path=str(one)))] == ["0+1=", "1+1="]


def test_hf_local_data_file_and_gsm8k_directory(tmp_path, monkeypatch):
    import datasets

    # load_dataset caches prepared data; keep it inside the test's directory.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS[:3])
    assert [t.answer for t in load_file_source(cfg(source="hf", path=path))] == ["1", "2", "3"]
    gsm = tmp_path / "gsm"
    gsm.mkdir()
    (gsm / "train.jsonl").write_text(GSM8K_SAMPLE.read_text())
    src = load_file_source(cfg(source="gsm8k", path=str(gsm)))
    assert [t.answer for t in src][:3] == ["7", "60", "105"]


def test_gsm8k_sample_and_math_reward_end_to_end():
    src = load_file_source(cfg(source="gsm8k", path=str(GSM8K_SAMPLE)))
    assert len(src) == 8 and src.default_reward == "math"
    assert [t.answer for t in src] == ["7", "60", "105", "24", "1500", "180", "12", "36"]
    first = src[0]
    assert first.prompt.startswith("Tom has 3 apples")
    assert first.info["solution"].endswith("#### 7")

    def completion(text: str) -> Trajectory:
        return Trajectory(src[4], (1,), (), (), (), (), text=text)

    assert math_reward(completion("250 * 6 = 1500, so \\boxed{1500}"))["reward"] == 1.0
    assert math_reward(completion("He earns $1,500 in total."))["reward"] == 1.0
    assert math_reward(completion("\\boxed{1250}"))["reward"] == 0.0


def test_missing_field_names_file_row_and_field(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], {"question": "x", "answer": "1"}, ROWS[1]])
    with pytest.raises(DataError) as e:
        load_file_source(cfg(source="jsonl", path=path))
    assert str(e.value) == (f"{path} row 2: missing field 'prompt' (data.prompt_field); "
                            "fix the row or set data.skip_invalid=true")


def test_skip_invalid_counts_and_warns_once(tmp_path, caplog):
    rows = [ROWS[0], {"answer": "1"}, "{not json", {"prompt": "", "answer": "1"},
            {"prompt": 5, "answer": "1"}, {"prompt": "ok=", "answer": None}, ROWS[1]]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="conveyor.data.files"):
        src = load_file_source(cfg(source="jsonl", path=path, skip_invalid=True))
    assert [t.id for t in src] == ["train-1", "train-7"]
    assert src.stats["skipped"] == 5 and src.stats["rows"] == 7
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "skipped 5 invalid rows of 7" in warnings[0]
    assert "row 2: missing field 'prompt'" in warnings[0]


def test_bytes_that_are_not_utf8_name_file_and_row_or_are_skipped(tmp_path):
    path = tmp_path / "latin1.jsonl"
    good = json.dumps(ROWS[0]).encode()
    path.write_bytes(b"\xef\xbb\xbf" + good + b"\n" + '{"prompt": "caf\u00e9=", "answer": "1"}'.encode("latin-1")
                     + b"\n" + json.dumps(ROWS[1]).encode())  # a BOM first; the last row has no newline
    with pytest.raises(DataError) as e:
        load_file_source(cfg(source="jsonl", path=str(path)))
    assert str(e.value) == (f"{path} row 2: is not UTF-8 text (byte 0xe9 at byte 16 of the line); save the "
                            "file as UTF-8; fix the row or set data.skip_invalid=true")
    src = load_file_source(cfg(source="jsonl", path=str(path), skip_invalid=True))
    assert [t.id for t in src] == ["train-1", "train-3"] and src.stats["skipped"] == 1


def test_missing_file_and_empty_data(tmp_path):
    with pytest.raises(DataError, match=r"data file .*nope.jsonl does not exist"):
        load_file_source(cfg(source="jsonl", path=str(tmp_path / "nope.jsonl")))
    path = write_jsonl(tmp_path / "empty.jsonl", [{"x": 1}])
    with pytest.raises(DataError, match=r"no valid rows \(1 read, 1 skipped\)"):
        load_file_source(cfg(source="jsonl", path=path, skip_invalid=True))


def test_chat_template_rendering_with_tiny_tokenizer(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", ROWS[:1])
    tok = build_tokenizer()
    src = load_file_source(cfg(source="jsonl", path=path, chat_template=True, system_prompt="Be brief."), tok)
    assert src[0].prompt == "<|system|>Be brief.\n<|user|>0+1=\n<|assistant|>"
    tok.chat_template = None
    with pytest.raises(DataError, match="the tokenizer has no chat template"):
        load_file_source(cfg(source="jsonl", path=path, chat_template=True), tok)
    with pytest.raises(DataError, match="no tokenizer was given"):
        load_file_source(cfg(source="jsonl", path=path, chat_template=True))


def test_prompt_template_errors(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", ROWS[:1])
    with pytest.raises(DataError, match="positional field"):
        load_file_source(cfg(source="jsonl", path=path, prompt_template="{} \\boxed{}"))
    with pytest.raises(DataError, match=r"row 1: data.prompt_template names field 'hint'"):
        load_file_source(cfg(source="jsonl", path=path, prompt_template="{prompt} {hint}"))
    src = load_file_source(cfg(source="jsonl", path=path, prompt_template="{prompt} (level {level}) \\boxed{{}}"))
    assert src[0].prompt == "0+1= (level 0) \\boxed{}"


def test_holdout_split_is_deterministic_and_disjoint(tmp_path):
    rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(20)]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    c = DataConfig(source="jsonl", path=path, eval_size=5, seed=3)
    train, ev = load_file_source(c), load_file_source(c, split="eval")
    train_ids, eval_ids = {t.id for t in train}, {t.id for t in ev}
    assert len(train_ids) == 15 and len(eval_ids) == 5 and not train_ids & eval_ids
    assert train_ids | eval_ids == {f"train-{i}" for i in range(1, 21)}
    assert [t.id for t in load_file_source(c, split="eval")] == [t.id for t in ev]
    assert train.stats["held_out"] == 5
    assert holdout_indices(20, 5, 3) == {int(i.split("-")[1]) - 1 for i in eval_ids}
    assert holdout_indices(20, 5, 4) != holdout_indices(20, 5, 3)
    with pytest.raises(DataError, match="data.eval_size=20 would hold out all 20 valid rows"):
        load_file_source(DataConfig(source="jsonl", path=path, eval_size=20))


def test_eval_path_and_bad_eval_split(tmp_path):
    train_path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    eval_path = write_jsonl(tmp_path / "eval.jsonl", ROWS[:2])
    c = DataConfig(source="jsonl", path=train_path, eval_path=eval_path)
    assert len(load_file_source(c)) == 6
    assert [t.id for t in load_file_source(c, split="eval")] == ["eval-1", "eval-2"]
    with pytest.raises(DataError, match="data.eval_split only selects a split of a Hugging Face dataset"):
        load_file_source(DataConfig(source="jsonl", path=train_path, eval_split="test"))


def test_unknown_source_and_split():
    with pytest.raises(DataError, match="is not a file source"):
        load_file_source(DataConfig(source="synthetic:addition"))
    with pytest.raises(DataError, match="split='dev' must be 'train' or 'eval'"):
        load_file_source(DataConfig(source="jsonl", path="x.jsonl"), split="dev")
