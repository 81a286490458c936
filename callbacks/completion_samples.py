"""CompletionSamples: every N iterations, a few prompts with their completions, rewards and advantages, to read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn

from .contracts import HasTokenizer, SampleBatch, SampleRecord, require
from .fit_end import is_last_epoch

# the table's columns before one `reward/<name>` column per reward component
COLUMNS = (
    "iteration",
    "version",
    "prompt_id",
    "sample_index",
    "prompt",
    "completion",
    "reward",
    "advantage",
    "truncated",
    "correct",
    "failures",
)


class CompletionSamples(Callback):
    r"""Write what the model wrote: a few prompts of an iteration with every completion, reward and advantage.

    The first thing to read when the reward rises suspiciously fast (reward hacking) or not at all. Every
    ``every_n_iterations`` iterations (epochs ``n - 1``, ``2n - 1``, ... counted from 0) and at the last
    one, the first ``prompts`` groups the trainer trained on that iteration are decoded with the module's
    tokenizer and appended to ``<dirpath>/<filename>``, one JSON object per sample (``load_samples`` reads
    them back)::

        {"iteration": 49, "version": 49, "prompt_id": 3136, "sample_index": 0, "prompt": "3917=",
         "completion": "3917<eos>", "reward": 1.0, "advantage": 0.87, "reward_components": {"positional": 1.0},
         "reward_failures": [], "truncated": false, "correct": true}

    Prompt and completion are decoded as the model saw and wrote them, special tokens kept, so a missing
    end token or a leaked template token shows. Each logger with ``log_table`` (``WandbLogger``), or else
    ``log_text``, gets the same rows as a table under ``key`` (the columns of ``COLUMNS``, then one
    ``reward/<name>`` per reward component), at the trainer's global step.

    On the training thread it only keeps references to the chosen groups' samples, read from each batch's
    ``trajectories`` (:class:`~lit_parl.callbacks.SampleBatch`; batches whose ``pass_index`` is not 0 replay
    samples already seen and are skipped); decoding and writing wait for the end of a due iteration. Only
    global rank 0 writes and logs, the samples of its own batches. The file is appended to: a run resumed
    from a checkpoint continues it, after dropping the lines written after that checkpoint.

    Override points: ``is_due(trainer)`` (which iterations are written), ``decode(pl_module, token_ids)``
    (how token ids become text), ``log_rows(trainer, rows)`` (where the rows go besides the file).

    Args:
        dirpath: the directory of the file. ``None``: ``trainer.default_root_dir``.
        every_n_iterations: write every this many iterations (and the last).
        prompts: how many groups (prompts, each with all its samples) per written iteration.
        filename: the JSON-lines file's name in ``dirpath``.
        key: the table's name in the loggers.

    Raises:
        ValueError: at construction, when ``every_n_iterations`` or ``prompts`` is below 1.
        TypeError: at fit start, when the LightningModule has no ``tokenizer`` with ``batch_decode``
            (:class:`~lit_parl.callbacks.HasTokenizer`); at the first batch, when it carries no
            ``trajectories`` of sample records (:class:`~lit_parl.callbacks.SampleRecord`).

    Example (three batches of one group each, a toy tokenizer)::

        >>> import lightning, tempfile, torch
        >>> from types import SimpleNamespace as Sample
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> class Tokenizer:  # anything with Hugging Face's batch_decode
        ...     def batch_decode(self, sequences, skip_special_tokens=False):
        ...         return [" ".join(map(str, ids)) for ids in sequences]
        >>> def group(prompt_id):
        ...     return Sample(pass_index=0, trajectories=[Sample(prompt_id=prompt_id, sample_index=k, version=0,
        ...         prompt_tokens=[prompt_id, 9], completion_tokens=[k, 0], reward=float(k), advantage=k - 0.5,
        ...         truncated=False, correct=k == 1, reward_components={"exact": float(k)}, reward_failures=())
        ...         for k in range(2)])
        >>> class Model(BoringModel):
        ...     tokenizer = Tokenizer()
        ...     def training_step(self, batch, batch_idx):
        ...         return self.layer(torch.ones(1, 32)).sum()
        ...     def train_dataloader(self):
        ...         return torch.utils.data.DataLoader([group(p) for p in range(3)], batch_size=None,
        ...             collate_fn=lambda b: b)
        >>> folder = tempfile.TemporaryDirectory()
        >>> samples = CompletionSamples(dirpath=folder.name, every_n_iterations=2, prompts=2)
        >>> trainer = lightning.Trainer(accelerator="cpu", max_epochs=3, limit_val_batches=0, logger=False,
        ...     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[samples])
        >>> trainer.fit(Model())
        >>> rows = load_samples(samples.path)
        >>> [(row["iteration"], row["prompt_id"], row["sample_index"]) for row in rows]
        [(1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1), (2, 0, 0), (2, 0, 1), (2, 1, 0), (2, 1, 1)]
        >>> rows[1]["prompt"], rows[1]["completion"], rows[1]["advantage"], rows[1]["reward_components"]
        ('0 9', '1 0', 0.5, {'exact': 1.0})
        >>> folder.cleanup()
    """

    def __init__(
        self,
        dirpath: str | None = None,
        every_n_iterations: int = 10,
        prompts: int = 4,
        filename: str = "samples.jsonl",
        key: str = "samples",
    ) -> None:
        if every_n_iterations < 1:
            raise ValueError(
                f"CompletionSamples(every_n_iterations={every_n_iterations}): must be >= 1 (1: every iteration)"
            )
        if prompts < 1:
            raise ValueError(f"CompletionSamples(prompts={prompts}): must be >= 1 group per written iteration")
        self.dirpath = dirpath
        self.every_n_iterations = every_n_iterations
        self.prompts = prompts
        self.filename = filename
        self.key = key
        self.path: Path | None = None  # the file, once fit started
        self.rows_written = 0  # lines of the file written by this run: checkpointed
        self._restored = False
        self._kept: dict[int, list[SampleRecord]] = {}  # prompt_id -> its samples seen so far, this iteration
        self._checked = False

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        require(
            pl_module,
            HasTokenizer,
            owner="CompletionSamples",
            role="the LightningModule",
            fix="Set `self.tokenizer` to the policy's Hugging Face tokenizer (GRPOModule takes `tokenizer=`).",
        )
        self.path = Path(self.dirpath or trainer.default_root_dir) / self.filename
        self._checked = False
        if trainer.is_global_zero:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self._restored and self.path.exists():
                # lines past the checkpoint were written by iterations this run trains again: drop them
                lines = self.path.read_text().splitlines(keepends=True)
                if len(lines) > self.rows_written:
                    self.path.write_text("".join(lines[: self.rows_written]))

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._kept = {}

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # the training thread: keep references only, decode at the iteration's end
        if getattr(batch, "pass_index", 0) != 0:
            return
        if not self._checked:
            fix = (
                "Train on batches with a `trajectories` list of per-sample records, "
                "such as lit_parl.data.micro_batch.MicroBatch."
            )
            require(batch, SampleBatch, owner="CompletionSamples", role="each training batch", fix=fix)
            if batch.trajectories:
                require(
                    batch.trajectories[0],
                    SampleRecord,
                    owner="CompletionSamples",
                    role="each record of a batch's `trajectories`",
                    fix=fix,
                )
            self._checked = True
        kept = self._kept
        for sample in batch.trajectories:
            group = kept.get(sample.prompt_id)
            if group is not None:
                group.append(sample)  # the rest of a group split over micro-batches
            elif len(kept) < self.prompts:
                kept[sample.prompt_id] = [sample]

    def is_due(self, trainer: Trainer) -> bool:
        """Whether the iteration now ending is written: every ``every_n_iterations``-th, and the last."""
        return (trainer.current_epoch + 1) % self.every_n_iterations == 0 or is_last_epoch(trainer)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        kept = self._kept
        if not trainer.is_global_zero or not self.is_due(trainer):
            return
        if not kept:
            rank_zero_warn(
                f"CompletionSamples: iteration {trainer.current_epoch} trained no first-pass samples; none written."
            )
            return
        rows = self.make_rows(trainer.current_epoch, pl_module, list(kept.values()))
        with self.path.open("a") as lines:
            lines.writelines(json.dumps(row) + "\n" for row in rows)
        self.rows_written += len(rows)
        self.log_rows(trainer, rows)

    def make_rows(
        self, iteration: int, pl_module: LightningModule, groups: list[list[SampleRecord]]
    ) -> list[dict[str, Any]]:
        """One JSON-ready row per sample of ``groups``, decoded: prompts once per group, completions in one call."""
        prompts = self.decode(pl_module, [group[0].prompt_tokens for group in groups])
        samples = [
            (prompt, sample)
            for prompt, group in zip(prompts, groups)
            for sample in sorted(group, key=lambda s: s.sample_index)
        ]
        completions = self.decode(pl_module, [sample.completion_tokens for _, sample in samples])
        return [
            {
                "iteration": iteration,
                "version": int(sample.version),
                "prompt_id": int(sample.prompt_id),
                "sample_index": int(sample.sample_index),
                "prompt": prompt,
                "completion": completion,
                "reward": float(sample.reward),
                "advantage": float(sample.advantage),
                "reward_components": {name: float(value) for name, value in sample.reward_components.items()},
                "reward_failures": list(sample.reward_failures),
                "truncated": bool(sample.truncated),
                "correct": bool(sample.correct),
            }
            for (prompt, sample), completion in zip(samples, completions)
        ]

    def decode(self, pl_module: LightningModule, token_ids: list[Any]) -> list[str]:
        """The text of each token-id list, special tokens kept (an end token or a chat marker stays visible)."""
        return pl_module.tokenizer.batch_decode([list(ids) for ids in token_ids], skip_special_tokens=False)

    def log_rows(self, trainer: Trainer, rows: list[dict[str, Any]]) -> None:
        """Send ``rows`` as a table to each logger that has ``log_table`` (or else ``log_text``)."""
        components = sorted({name for row in rows for name in row["reward_components"]})
        columns = [*COLUMNS, *(f"reward/{name}" for name in components)]
        data = [
            [
                *(row[c] for c in COLUMNS[:-1]),
                ",".join(row["reward_failures"]),
                *(row["reward_components"].get(n) for n in components),
            ]
            for row in rows
        ]
        for logger in trainer.loggers:
            if callable(getattr(logger, "log_table", None)):
                logger.log_table(key=self.key, columns=columns, data=data, step=trainer.global_step)
            elif callable(getattr(logger, "log_text", None)):  # a text table: strings only
                text = [["" if value is None else str(value) for value in line] for line in data]
                logger.log_text(key=self.key, columns=columns, data=text, step=trainer.global_step)

    def state_dict(self) -> dict[str, Any]:
        return {"rows_written": self.rows_written}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rows_written = state_dict["rows_written"]
        self._restored = True


def load_samples(path: str | Path) -> list[dict[str, Any]]:
    """The rows a ``CompletionSamples`` appended to its file, in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]
