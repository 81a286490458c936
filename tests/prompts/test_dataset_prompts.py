"""``DatasetPrompts``: every file format loads, columns map onto ``PromptRow``, the evaluation set never
overlaps training, and each kind of bad input is refused naming the file, row, column or setting."""

from __future__ import annotations

import json
import shutil

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lit_parl.prompts.dataset_prompts import DatasetPrompts, DatasetRows
from lit_parl.prompts.prompt_row import PromptSource

RECORDS = [{"prompt": f"question {i}?", "answer": str(i * 2), "level": i % 3, "tags": [f"t{i}"]} for i in range(10)]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture
def load(tmp_path):
    """``DatasetPrompts`` with its Arrow cache under this test's tmp_path, not ~/.cache."""

    def make(**kwargs) -> DatasetPrompts:
        return DatasetPrompts(cache_dir=str(tmp_path / "cache"), **kwargs)

    return make


def _write(tmp_path, kind: str) -> str:
    table = datasets.Dataset.from_list(RECORDS)
    if kind == "jsonl":
        return write_jsonl(tmp_path / "rows.jsonl", RECORDS)
    if kind == "json":
        (tmp_path / "rows.json").write_text(json.dumps(RECORDS))
        return str(tmp_path / "rows.json")
    if kind == "parquet":
        pq.write_table(pa.Table.from_pylist(RECORDS), tmp_path / "rows.parquet")
        return str(tmp_path / "rows.parquet")
    if kind == "csv":
        table.remove_columns("tags").to_csv(tmp_path / "rows.csv", index=False)
        return str(tmp_path / "rows.csv")
    if kind in ("save_to_disk", "arrow"):
        table.save_to_disk(tmp_path / "saved")
        if kind == "save_to_disk":
            return str(tmp_path / "saved")
        shutil.copy(next((tmp_path / "saved").glob("*.arrow")), tmp_path / "rows.arrow")
        return str(tmp_path / "rows.arrow")
    if kind == "glob":
        write_jsonl(tmp_path / "part-0.jsonl", RECORDS[:4])
        write_jsonl(tmp_path / "part-1.jsonl", RECORDS[4:])
        return str(tmp_path / "part-*.jsonl")
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "csv", "save_to_disk", "arrow", "glob"])
def test_every_format_loads_the_same_rows(tmp_path, load, kind):
    # CSV types are guessed from the text: the answers read back as numbers
    prompts = load(path=_write(tmp_path, kind), answer_as_text=kind == "csv")
    assert isinstance(prompts, PromptSource)
    assert prompts.num_rows == len(RECORDS) and prompts.evaluation() is None
    row = prompts.row(7)
    assert (row.index, row.prompt, row.answer, row.is_chat) == (7, "question 7?", "14", False)
    assert row.metadata["level"] == 1
    if kind != "csv":  # CSV holds no lists
        assert row.metadata["tags"] == ["t7"]


def test_metadata_is_every_other_column_or_the_chosen_ones_as_plain_python(tmp_path, load):
    path = write_jsonl(tmp_path / "m.jsonl", [{"prompt": "p", "answer": "a", "n": 3, "info": {"src": "x", "w": 0.5}}])
    row = load(path=path).row(0)
    assert dict(row.metadata) == {"n": 3, "info": {"src": "x", "w": 0.5}}
    assert type(row.metadata["n"]) is int and type(row.metadata["info"]) is dict
    assert dict(load(path=path, metadata_columns=["n"]).row(0).metadata) == {"n": 3}
    assert dict(load(path=path, metadata_columns="info").row(0).metadata) == {
        "info": {"src": "x", "w": 0.5}
    }  # not 4 letters
    assert dict(load(path=path, metadata_columns=[]).row(0).metadata) == {}
    # no answer column: the answer column is metadata like any other
    row = load(path=path, answer_column=None, metadata_columns=None).row(0)
    assert row.answer is None and row.metadata["answer"] == "a"


def test_a_messages_column_makes_chat_rows(tmp_path, load):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": chat, "answer": "4", "prompt": "unused text"}])
    row = load(path=path, messages_column="messages").row(0)
    assert row.is_chat and row.prompt is None and row.answer == "4"
    assert [dict(m) for m in row.messages] == chat
    assert dict(row.metadata) == {"prompt": "unused text"}  # the unused prompt column is just another column


def test_eval_split_reads_another_split(tmp_path, load):
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(RECORDS[:6]), "test": datasets.Dataset.from_list(RECORDS[6:])}
    ).save_to_disk(tmp_path / "dd")
    prompts = load(path=str(tmp_path / "dd"), eval_split="test")
    evaluation = prompts.evaluation()
    assert (prompts.num_rows, evaluation.num_rows) == (6, 4)
    assert evaluation.row(0).prompt == "question 6?" and evaluation.row(0).index == 0
    assert load(path=str(tmp_path / "dd"), split="test").row(3).prompt == "question 9?"
    # a folder of data files named by split works the same way
    (tmp_path / "splits").mkdir()
    write_jsonl(tmp_path / "splits" / "train.jsonl", RECORDS[:7])
    write_jsonl(tmp_path / "splits" / "test.jsonl", RECORDS[7:])
    prompts = load(path=str(tmp_path / "splits"), eval_split="test")
    assert (prompts.num_rows, prompts.evaluation().num_rows) == (7, 3)
    assert prompts.evaluation().row(2).prompt == "question 9?"


def _prompts(source) -> list[str]:
    return [source.row(i).prompt for i in range(source.num_rows)]


def test_eval_rows_holds_out_rows_disjoint_from_training_and_fixed_by_the_seed(tmp_path, load):
    records = [{"prompt": f"q{i}", "answer": str(i)} for i in range(50)]
    path = write_jsonl(tmp_path / "many.jsonl", records)
    prompts = load(path=path, eval_rows=10, seed=1)
    evaluation = prompts.evaluation()
    train, held = _prompts(prompts), _prompts(evaluation)
    assert (len(train), len(held)) == (40, 10)
    assert not set(train) & set(held) and set(train) | set(held) == {r["prompt"] for r in records}
    # each row keeps its index in the file, so errors and logs name the file's row
    for source in (prompts, evaluation):
        for i in range(source.num_rows):
            row = source.row(i)
            assert row.prompt == records[row.index]["prompt"]
    assert held == _prompts(load(path=path, eval_rows=10, seed=1).evaluation())
    assert held != _prompts(load(path=path, eval_rows=10, seed=2).evaluation())


def test_answer_as_text_converts_numbers(tmp_path, load):
    path = write_jsonl(tmp_path / "i.jsonl", [{"prompt": "a", "answer": 4}, {"prompt": "b", "answer": -7}])
    prompts = load(path=path, answer_as_text=True)
    assert [prompts.row(0).answer, prompts.row(1).answer] == ["4", "-7"]
    path = write_jsonl(tmp_path / "f.jsonl", [{"prompt": "a", "answer": 2.5}])
    assert load(path=path, answer_as_text=True).row(0).answer == "2.5"


def test_rows_are_checked_when_read_not_when_built(tmp_path, load):
    # 100k rows: building reads only the schema; the bad last row shows up in row() and validate_all()
    count = 100_000
    prompts = [f"q{i}" for i in range(count - 1)] + [""]
    pq.write_table(pa.table({"prompt": prompts, "answer": ["a"] * count}), tmp_path / "big.parquet")
    source = load(path=str(tmp_path / "big.parquet"))
    assert source.num_rows == count and source.row(count - 2).prompt == f"q{count - 2}"
    with pytest.raises(
        ValueError, match=rf"big\.parquet \(split 'train'\), row {count - 1}: the prompt is empty \(column 'prompt'"
    ):
        source.row(count - 1)
    with pytest.raises(ValueError, match=rf"row {count - 1}: the prompt is empty"):
        source.validate_all()
    # validate_all covers exactly this source's rows: holding the bad row out leaves a valid training set
    table = datasets.Dataset.from_dict({"prompt": ["x", "", "y"], "answer": ["1", "2", "3"]})
    source = DatasetRows(table, where="mem", indices=np.array([0, 2]))
    source.validate_all()
    with pytest.raises(IndexError, match="row 2 is out of range, there are 2 rows"):
        source.row(2)


def test_loading_leaves_the_progress_bar_setting_as_it_was(tmp_path, load):
    path = write_jsonl(tmp_path / "p.jsonl", RECORDS)
    was = datasets.are_progress_bars_disabled()
    datasets.enable_progress_bars()
    try:
        load(path=path)
        assert not datasets.are_progress_bars_disabled()
    finally:
        (datasets.disable_progress_bars if was else datasets.enable_progress_bars)()


def test_a_hub_name_loads_through_datasets(monkeypatch, load):
    calls = []

    def fake_load_dataset(name, subset, cache_dir=None):
        calls.append((name, subset))
        splits = {"train": RECORDS, "test": RECORDS[:2], "empty": []}
        return datasets.DatasetDict(
            {
                k: datasets.Dataset.from_dict({"prompt": [r["prompt"] for r in v], "answer": [r["answer"] for r in v]})
                for k, v in splits.items()
            }
        )

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    prompts = load(name="openai/gsm8k", subset="main", eval_split="test")
    assert calls == [("openai/gsm8k", "main")] and (prompts.num_rows, prompts.evaluation().num_rows) == (10, 2)
    with pytest.raises(
        ValueError, match=r"hub dataset 'openai/gsm8k' \('main'\) has no split 'validation' \(set split\)"
    ):
        load(name="openai/gsm8k", subset="main", split="validation")
    with pytest.raises(ValueError, match=r"hub dataset 'openai/gsm8k' \('main'\) \(split 'empty'\) has no rows"):
        load(name="openai/gsm8k", subset="main", split="empty")
    with pytest.raises(ValueError, match=r"\(split 'empty'\) has no rows"):
        load(name="openai/gsm8k", subset="main", eval_split="empty")


# -- bad input: each refused naming what is wrong and how to fix it


def test_a_missing_column_lists_the_columns_there_are(tmp_path, load):
    path = write_jsonl(tmp_path / "c.jsonl", [{"question": "q", "answer": "a", "level": 1}])
    columns = r"its columns: \['question', 'answer', 'level'\]"
    with pytest.raises(
        ValueError, match=rf"c\.jsonl \(split 'train'\) has no column 'prompt' \(set prompt_column\); {columns}"
    ):
        load(path=path)
    with pytest.raises(ValueError, match=rf"has no column 'solution' \(set answer_column\); {columns}"):
        load(path=path, prompt_column="question", answer_column="solution")
    with pytest.raises(ValueError, match=rf"has no column 'chat' \(set messages_column\); {columns}"):
        load(path=path, messages_column="chat")
    with pytest.raises(ValueError, match=rf"has no column 'source' \(set metadata_columns\); {columns}"):
        load(path=path, prompt_column="question", metadata_columns=["level", "source"])
    with pytest.raises(ValueError, match="set prompt_column .* or messages_column"):
        load(path=path, prompt_column=None)


def test_an_empty_or_missing_prompt_names_file_row_and_column(tmp_path, load):
    path = write_jsonl(
        tmp_path / "e.jsonl", [{"prompt": "ok", "answer": "1"}, {"prompt": "  ", "answer": "2"}, {"answer": "3"}]
    )
    prompts = load(path=path)
    with pytest.raises(
        ValueError, match=r"e\.jsonl \(split 'train'\), row 1: the prompt is empty \(column 'prompt'; fix or drop"
    ):
        prompts.row(1)
    with pytest.raises(ValueError, match=r"e\.jsonl \(split 'train'\), row 2: column 'prompt' is empty \(fix or drop"):
        prompts.row(2)


def test_messages_that_are_not_role_content_dicts_are_refused(tmp_path, load):
    path = write_jsonl(tmp_path / "s.jsonl", [{"messages": "just text", "answer": "1"}])
    with pytest.raises(
        ValueError, match=r"s\.jsonl \(split 'train'\), row 0: messages must be a non-empty list .*column 'messages'"
    ):
        load(path=path, messages_column="messages").row(0)
    good, no_content = [{"role": "user", "content": "hi"}], [{"role": "user"}]
    path = write_jsonl(
        tmp_path / "d.jsonl", [{"messages": good, "answer": "1"}, {"messages": no_content, "answer": "2"}]
    )
    prompts = load(path=path, messages_column="messages")
    assert prompts.row(0).is_chat
    with pytest.raises(
        ValueError,
        match=r"d\.jsonl \(split 'train'\), row 1: message 0 must be a dict with string 'role' and 'content'",
    ):
        prompts.row(1)


def test_a_non_string_answer_names_the_setting_that_fixes_it(tmp_path, load):
    path = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "p", "answer": 4}])
    with pytest.raises(
        ValueError,
        match=(
            r"a\.jsonl \(split 'train'\), row 0: column 'answer' must hold a string answer, "
            r"got int 4 \(set answer_as_text=True"
        ),
    ):
        load(path=path).row(0)
    # a list is not a number: answer_as_text does not turn it into text
    path = write_jsonl(tmp_path / "l.jsonl", [{"prompt": "p", "answer": ["4", "four"]}])
    with pytest.raises(
        ValueError, match=r"row 0: column 'answer' must hold a string answer, got list .*set answer_column=None"
    ):
        load(path=path, answer_as_text=True).row(0)


def test_a_missing_file_or_unmatched_glob(tmp_path, load):
    with pytest.raises(FileNotFoundError, match=r"path='.*nowhere\.jsonl': no such file"):
        load(path=str(tmp_path / "nowhere.jsonl"))
    with pytest.raises(FileNotFoundError, match=r"no such file, folder or matching files"):
        load(path=str(tmp_path / "none-*.parquet"))


def test_an_unparsable_file_is_named_even_inside_a_glob(tmp_path, load):
    write_jsonl(tmp_path / "p-0.jsonl", RECORDS)
    (tmp_path / "p-1.jsonl").write_text(json.dumps(RECORDS[0]) + "\n{broken\n")
    with pytest.raises(ValueError, match=r"could not parse .*p-1\.jsonl as json: JSON parse error"):
        load(path=str(tmp_path / "p-1.jsonl"))
    with pytest.raises(ValueError, match=r"could not parse .*p-1\.jsonl as json"):
        load(path=str(tmp_path / "p-*.jsonl"))


def test_an_unknown_extension_lists_the_known_ones(tmp_path, load):
    (tmp_path / "rows.txt").write_text("question 1?\n")
    with pytest.raises(
        ValueError, match=r"cannot tell the format from the extension \.txt; give \.jsonl, \.json, \.parquet"
    ):
        load(path=str(tmp_path / "rows.txt"))
    write_jsonl(tmp_path / "m.jsonl", RECORDS)
    pq.write_table(pa.Table.from_pylist(RECORDS), tmp_path / "m.parquet")
    with pytest.raises(ValueError, match=r"extension \.jsonl, \.parquet; give .* files of one kind"):
        load(path=str(tmp_path / "m.*"))


@pytest.mark.parametrize("eval_rows", [10, 11])
def test_eval_rows_that_leave_nothing_to_train_on(tmp_path, load, eval_rows):
    path = write_jsonl(tmp_path / "r.jsonl", RECORDS)
    with pytest.raises(
        ValueError,
        match=(
            rf"eval_rows={eval_rows} holds out every row of .*r\.jsonl \(split 'train', 10 rows\)"
            r".*set eval_rows below 10"
        ),
    ):
        load(path=path, eval_rows=eval_rows)
    with pytest.raises(ValueError, match="eval_rows must be >= 0"):
        load(path=path, eval_rows=-1)


def test_path_and_name_exactly_one(tmp_path, load):
    with pytest.raises(ValueError, match="give exactly one of path .* and name"):
        load()
    with pytest.raises(ValueError, match="give exactly one of path .* and name"):
        load(path=write_jsonl(tmp_path / "x.jsonl", RECORDS), name="openai/gsm8k")


def test_split_settings_that_cannot_work(tmp_path, load):
    path = write_jsonl(tmp_path / "x.jsonl", RECORDS)
    with pytest.raises(ValueError, match=r"x\.jsonl has no split 'test' \(set eval_split\); its splits: \['train'\]"):
        load(path=path, eval_split="test")
    with pytest.raises(ValueError, match=r"has no split 'validation' \(set split\)"):
        load(path=path, split="validation")
    with pytest.raises(ValueError, match="eval_split='train' is the training split"):
        load(path=path, eval_split="train")
    with pytest.raises(ValueError, match="eval_split .* or eval_rows .*, not both"):
        load(path=path, eval_split="test", eval_rows=2)


def test_a_folder_that_holds_no_dataset(tmp_path, load):
    (tmp_path / "nothing").mkdir()
    with pytest.raises(ValueError, match=r"could not read the folder .*nothing as a dataset"):
        load(path=str(tmp_path / "nothing"))
