"""Where a fit and its iterations end, read the same way by every callback: the fit loop's own rules.

A fit stops before ``max_epochs`` on a stop request (``max_time``, early stopping, a callback setting
``trainer.should_stop``) or at ``max_steps``; Lightning then ends the running epoch after the batch it is on,
which may be inside an iteration. An iteration ends with its epoch's last batch.

Example::

    >>> from types import SimpleNamespace
    >>> trainer = SimpleNamespace(should_stop=False, max_steps=-1, global_step=7, max_epochs=3, current_epoch=1)
    >>> is_last_epoch(trainer)
    False
    >>> trainer.current_epoch = 2; is_last_epoch(trainer)
    True
    >>> trainer.current_epoch, trainer.should_stop = 1, True; is_last_epoch(trainer)
    True
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_warn

from .contracts import IterationRecord, require


def is_last_epoch(trainer: Trainer) -> bool:
    """Whether the fit ends after the epoch now running (its epoch limit, its step limit, or a stop request)."""
    if trainer.should_stop or (trainer.max_steps >= 0 and trainer.global_step >= trainer.max_steps):
        return True
    max_epochs = trainer.max_epochs
    return max_epochs is not None and max_epochs >= 0 and trainer.current_epoch + 1 >= max_epochs


def ends_iteration(trainer: Trainer) -> bool:
    """Whether the batch just trained is the epoch's last: the data ran out, or the epoch's batch limit is reached.

    An iteration is booked here, in ``on_train_batch_end``, not at its epoch's end: a checkpoint written after the
    last batch (``ModelCheckpoint`` runs after the other callbacks) then holds the booking, and Lightning, which
    resumes from such a checkpoint at the next epoch, never runs the skipped epoch end. A fit stopped inside an
    iteration (``max_time``) has no such batch: nothing is booked for the unfinished iteration."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return bool(progress.is_last_batch) or progress.current.ready >= trainer.num_training_batches


def new_record(trainer: Trainer, last_record: Any, owner: str, left_out_of: str) -> Any:
    """The record the datamodule booked for the iteration just trained (the last of its ``history``), or ``None``
    (with a warning: the datamodule did not book it, and ``owner`` leaves it out) when none is newer than
    ``last_record``. Called after an iteration's last batch (``ends_iteration``)."""
    history = trainer.datamodule.history
    record = history[-1] if history else None
    if record is None or record is last_record:
        rank_zero_warn(
            f"{owner}: iteration {trainer.current_epoch} ended without a new record in "
            f"{type(trainer.datamodule).__name__}.history; it is left out of the {left_out_of}."
        )
        return None
    require(
        record,
        IterationRecord,
        owner=owner,
        role="each record of the datamodule's `history`",
        fix=(
            "Append records with the fields of lit_parl.callbacks.IterationRecord "
            "(lit_parl.data.iteration_stats.IterationStats has them)."
        ),
    )
    return record


class EpochEndLogs:
    """Values booked after an iteration's last batch and logged at its epoch's end, after ``WeightSync``'s push.

    Lightning's ``log`` costs about half a millisecond a call; made after the last batch, those calls sit between
    the last training step and the next iteration's weight push, with the pool idle. Logged from
    ``on_train_epoch_end`` by a callback listed after ``WeightSync`` they overlap the next iteration's generation.
    What is booked (a callback's totals, the timeline's line) stays with the last batch, so a checkpoint holds it;
    a resume that skips the epoch's end loses only these logged values, like the module's own epoch-end metrics.
    """

    def __init__(self) -> None:
        self._due: dict[str, tuple[float, bool]] = {}

    def book(self, name: str, value: float, prog_bar: bool = False) -> None:
        self._due[name] = (value, prog_bar)

    def log(self, pl_module: Any) -> None:
        for name, (value, prog_bar) in self._due.items():
            pl_module.log(name, value, prog_bar=prog_bar, on_step=False, on_epoch=True, batch_size=1)
        self._due = {}
