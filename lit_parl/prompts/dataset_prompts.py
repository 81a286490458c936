"""Prompt datasets from files or the Hugging Face hub: a ``PromptSource`` over a ``datasets.Dataset``.

``DatasetPrompts`` loads a split with Hugging Face ``datasets`` (JSONL/JSON, Parquet, CSV, Arrow, a folder
written by ``save_to_disk``, a folder of split files such as ``train.jsonl`` + ``test.jsonl``, or a hub
dataset) and hands out its rows as ``PromptRow``s. Rows stay in the memory-mapped Arrow table and are turned
into Python values one at a time, in ``row(i)``; the column names are checked when the source is built and
each row's contents when it is read (or all at once by ``validate_all()``). An evaluation set is either
another split (``eval_split``) or rows held out of the training split (``eval_rows``, chosen from ``seed``).

Example::

    >>> import json, os, tempfile
    >>> tmp = tempfile.TemporaryDirectory()
    >>> path = os.path.join(tmp.name, "math.jsonl")
    >>> with open(path, "w") as f:
    ...     for q, a, level in [("1+1?", "2", 1), ("2*3?", "6", 2), ("9-4?", "5", 1)]:
    ...         _ = f.write(json.dumps({"question": q, "answer": a, "level": level}) + "\\n")
    >>> prompts = DatasetPrompts(path=path, prompt_column="question", eval_rows=1, cache_dir=tmp.name)
    >>> prompts.num_rows, prompts.evaluation().num_rows
    (2, 1)
    >>> row = DatasetPrompts(path=path, prompt_column="question", cache_dir=tmp.name).row(1)
    >>> row.prompt, row.answer, dict(row.metadata)
    ('2*3?', '6', {'level': 2})
    >>> DatasetPrompts(path=path, cache_dir=tmp.name)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: .../math.jsonl (split 'train') has no column 'prompt' (set prompt_column);
    its columns: ['question', 'answer', 'level']
    >>> tmp.cleanup()
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Iterator, Sequence
from typing import Any

import datasets
import numpy as np

from lit_parl.prompts.prompt_row import PromptRow

# the file formats Hugging Face ``datasets`` reads, by extension (the name of its packaged builder)
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


class DatasetRows:
    """A ``PromptSource`` over an already loaded ``datasets.Dataset``: the rows at ``indices`` (all of them by default).

    Args:
        dataset: the split to read.
        where: how errors name it, e.g. ``"data/train.jsonl (split 'train')"``.
        prompt_column: the column holding the prompt text (ignored when ``messages_column`` is set).
        messages_column: the column holding chat turns (lists of ``{"role", "content"}`` dicts).
        answer_column: the column holding the reference answer; ``None``: rows have no answer.
        metadata_columns: the columns passed to rewards as ``PromptRow.metadata``; ``None``: every column
            that is not the prompt, messages or answer.
        answer_as_text: turn int and float answers into text with ``str()`` rather than refuse them.
        indices: the dataset rows this source hands out, in order; ``PromptRow.index`` is the dataset's row.
    """

    def __init__(
        self,
        dataset: datasets.Dataset,
        *,
        where: str,
        prompt_column: str | None = "prompt",
        messages_column: str | None = None,
        answer_column: str | None = "answer",
        metadata_columns: Sequence[str] | None = None,
        answer_as_text: bool = False,
        indices: np.ndarray | None = None,
    ) -> None:
        self.where = where
        self.answer_as_text = answer_as_text
        # a messages column decides chat rows; prompt_column keeps its default then, so it is simply unused
        self.text_column, self.chat = (messages_column, True) if messages_column else (prompt_column, False)
        if not self.text_column:
            raise ValueError(f"{where}: set prompt_column (the prompt text) or messages_column (chat turns)")
        self.answer_column = answer_column
        existing = list(dataset.column_names)
        used = [self.text_column] + ([answer_column] if answer_column else [])
        if metadata_columns is None:
            metadata_columns = [c for c in existing if c not in used]
        elif isinstance(metadata_columns, str):
            metadata_columns = [metadata_columns]
        self.metadata_columns = list(metadata_columns)
        settings = [("messages_column" if self.chat else "prompt_column", self.text_column)]
        settings += [("answer_column", answer_column)] if answer_column else []
        settings += [("metadata_columns", c) for c in self.metadata_columns]
        for setting, column in settings:
            if column not in existing:
                raise ValueError(f"{where} has no column {column!r} (set {setting}); its columns: {existing}")
        # read only the columns in use, as plain Python values whatever format the dataset was saved with
        self.dataset = dataset.select_columns(list(dict.fromkeys(used + self.metadata_columns))).with_format(None)
        self.indices = indices

    @property
    def num_rows(self) -> int:
        return len(self.dataset) if self.indices is None else len(self.indices)

    def row(self, index: int) -> PromptRow:
        if not 0 <= index < self.num_rows:
            raise IndexError(f"{self.where}: row {index} is out of range, there are {self.num_rows} rows")
        source_index = index if self.indices is None else int(self.indices[index])
        return self._make_row(source_index, self.dataset[source_index])

    def validate_all(self) -> None:
        """Read every row once, raising the first row's error (an empty prompt, a bad answer...)."""
        for source_index, record in self._records():
            self._make_row(source_index, record)

    def _records(self, batch_size: int = 1024) -> Iterator[tuple[int, dict[str, Any]]]:
        # whole Arrow batches to Python at once: far faster than one ``dataset[i]`` per row
        dataset = self.dataset if self.indices is None else self.dataset.select(self.indices)
        order = range(len(dataset)) if self.indices is None else self.indices
        position = 0
        for batch in dataset.iter(batch_size=batch_size):
            for offset in range(len(batch[self.text_column])):
                yield int(order[position + offset]), {k: v[offset] for k, v in batch.items()}
            position += len(batch[self.text_column])

    def _make_row(self, index: int, record: dict[str, Any]) -> PromptRow:
        answer = record[self.answer_column] if self.answer_column else None
        if self.answer_column and not isinstance(answer, str):
            convertible = isinstance(answer, (int, float)) and not isinstance(answer, bool)
            if convertible and self.answer_as_text:
                answer = str(answer)
            else:
                fix = (
                    "set answer_as_text=True to convert numbers with str()"
                    if convertible
                    else "give every row a text answer, or set answer_column=None when the dataset has none"
                )
                raise ValueError(
                    f"{self.where}, row {index}: column {self.answer_column!r} must hold a string answer, "
                    f"got {type(answer).__name__} {answer!r:.80} ({fix})"
                )
        text = record[self.text_column]
        if text is None:  # a missing JSON key or an empty CSV cell
            raise ValueError(f"{self.where}, row {index}: column {self.text_column!r} is empty (fix or drop that row)")
        try:
            return PromptRow(
                index=index,
                prompt=None if self.chat else text,
                messages=text if self.chat else None,
                answer=answer,
                metadata={c: record[c] for c in self.metadata_columns},
            )
        except ValueError as error:
            raise ValueError(f"{self.where}, {error} (column {self.text_column!r}; fix or drop that row)") from error


class DatasetPrompts(DatasetRows):
    """A ``PromptSource`` over a dataset file, folder or hub dataset, with an optional evaluation set.

    Args:
        path: a local ``.jsonl``/``.json``, ``.parquet``, ``.csv`` or ``.arrow`` file, a glob of such files,
            a folder written by ``save_to_disk``, or a folder of data files named by split (``train.jsonl``,
            ``test.jsonl``). A file or glob holds the one split ``"train"``.
        name: a Hugging Face hub dataset (downloaded with ``datasets.load_dataset``); give ``path`` or ``name``.
        subset: the hub dataset's configuration, e.g. ``"main"`` for ``"openai/gsm8k"``.
        split: the split to train on.
        prompt_column, messages_column, answer_column, metadata_columns, answer_as_text: as in ``DatasetRows``.
        eval_split: another split to evaluate on (e.g. ``"test"``).
        eval_rows: or this many rows held out of ``split``, never trained on, chosen from ``seed``.
        seed: which rows ``eval_rows`` holds out.
        cache_dir: where ``datasets`` writes its Arrow cache (``None``: its default, ``~/.cache/huggingface``).
    """

    def __init__(
        self,
        path: str | None = None,
        name: str | None = None,
        subset: str | None = None,
        split: str = "train",
        prompt_column: str | None = "prompt",
        messages_column: str | None = None,
        answer_column: str | None = "answer",
        metadata_columns: list[str] | None = None,
        eval_split: str | None = None,
        eval_rows: int = 0,
        seed: int = 0,
        answer_as_text: bool = False,
        cache_dir: str | None = None,
    ) -> None:
        if (path is None) == (name is None):
            raise ValueError("give exactly one of path (a local file or folder) and name (a hub dataset)")
        if eval_split is not None and eval_rows:
            raise ValueError("give eval_split (another split) or eval_rows (rows held out of split), not both")
        if eval_split is not None and eval_split == split:
            raise ValueError(
                f"eval_split={eval_split!r} is the training split; evaluate on another split or use eval_rows"
            )
        if eval_rows < 0:
            raise ValueError(f"eval_rows must be >= 0, got {eval_rows}")
        source = path if path is not None else f"hub dataset {name!r}" + (f" ({subset!r})" if subset else "")
        with _quiet():
            if path is not None:
                splits = _load_path(path, cache_dir)
            else:
                splits = dict(datasets.load_dataset(name, subset, cache_dir=cache_dir))
        columns = dict(
            prompt_column=prompt_column,
            messages_column=messages_column,
            answer_column=answer_column,
            metadata_columns=metadata_columns,
            answer_as_text=answer_as_text,
        )
        train = _split(splits, split, "split", source)
        size = len(train)
        indices = None
        self._evaluation: DatasetRows | None = None
        if eval_rows:
            if eval_rows >= size:
                raise ValueError(
                    f"eval_rows={eval_rows} holds out every row of {source} (split {split!r}, {size} rows), "
                    f"leaving none to train on; set eval_rows below {size}, or use eval_split"
                )
            held_out = np.sort(np.random.default_rng(seed).choice(size, size=eval_rows, replace=False))
            indices = np.setdiff1d(np.arange(size), held_out)
            self._evaluation = DatasetRows(
                train, where=f"{source} (split {split!r}, held out)", indices=held_out, **columns
            )
        elif eval_split is not None:
            evaluation = _split(splits, eval_split, "eval_split", source)
            self._evaluation = DatasetRows(evaluation, where=f"{source} (split {eval_split!r})", **columns)
        super().__init__(train, where=f"{source} (split {split!r})", indices=indices, **columns)

    def evaluation(self) -> DatasetRows | None:
        """The evaluation rows (``eval_split`` or the ``eval_rows`` held out), or ``None`` when neither is set."""
        return self._evaluation


def _load_path(path: str, cache_dir: str | None) -> dict[str, datasets.Dataset]:
    """The splits at ``path``, by name; a clear error for a missing, unknown or unreadable file."""
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        try:
            if any(os.path.exists(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json")):
                loaded = datasets.load_from_disk(path)
                return dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
            # a folder of data files: ``datasets`` infers the format and the splits from the file names
            return dict(datasets.load_dataset(path, cache_dir=cache_dir))
        except Exception as error:
            cause = f" ({error.__cause__})" if error.__cause__ else ""
            raise ValueError(
                f"could not read the folder {path} as a dataset: {type(error).__name__}: {error}{cause}"
            ) from error
    files = sorted(glob.glob(path)) if glob.has_magic(path) else [path] if os.path.exists(path) else []
    if not files:
        raise FileNotFoundError(f"path={path!r}: no such file, folder or matching files")
    extensions = sorted({os.path.splitext(f)[1].lower() for f in files})
    if len(extensions) > 1 or extensions[0] not in FORMATS:
        raise ValueError(
            f"path={path!r}: cannot tell the format from the extension {', '.join(extensions) or '(none)'}; "
            f"give {', '.join(FORMATS)} files of one kind, or a folder written by save_to_disk"
        )
    builder = FORMATS[extensions[0]]
    try:
        return dict(datasets.load_dataset(builder, data_files=files, cache_dir=cache_dir))
    except Exception as error:
        # name the file that breaks, not just the glob: retry them one by one (only on this failure path)
        broken = next((f for f in files if not _readable(builder, f, cache_dir)), None) if len(files) > 1 else files[0]
        cause = error.__cause__ or error
        raise ValueError(f"could not parse {broken or path} as {builder}: {cause}") from error


def _readable(builder: str, file: str, cache_dir: str | None) -> bool:
    try:
        datasets.load_dataset(builder, data_files=file, cache_dir=cache_dir)
    except Exception:
        return False
    return True


def _split(splits: dict[str, datasets.Dataset], split: str, setting: str, source: str) -> datasets.Dataset:
    if split not in splits:
        raise ValueError(f"{source} has no split {split!r} (set {setting}); its splits: {list(splits)}")
    if len(splits[split]) == 0:
        raise ValueError(f"{source} (split {split!r}) has no rows")
    return splits[split]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No progress bars while loading, then the user's setting back."""
    were_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not were_disabled:
            datasets.enable_progress_bars()
