"""IterationProgress: where the module is inside the current iteration, so that a checkpoint written anywhere resumes.

A checkpoint can be written after any micro-batch (Lightning's ``every_n_train_steps``, ``train_time_interval``,
right after a resume), or at the end of an epoch that a stop (``max_time``) cut inside its iteration. The
weights and the optimizer in it are those after the last optimizer step: the micro-batches trained since then
only added to a gradient that no checkpoint holds. So the checkpoint is made to say what it holds (``rewind``):
Lightning's count of the epoch's trained batches is moved back to that step, and an epoch cut by a stop is
marked unfinished, so that Lightning resumes inside it (not at the next epoch, which would start the next
iteration early). A resume trains those micro-batches again, from the same weights: exactly.

Whether a checkpoint was written inside an iteration (``inside``) decides whether θ_k must travel in it.

Example::

    >>> progress = IterationProgress(optimizer_steps=2)
    >>> progress.micro_batch(); progress.optimizer_step(); progress.micro_batch()
    >>> progress.inside, progress.since_step
    (True, 1)
    >>> batches = {"ready": 5, "started": 5, "processed": 5, "completed": 4}
    >>> epochs = {"ready": 1, "started": 1, "processed": 1, "completed": 0}  # written at the end of a cut epoch
    >>> checkpoint = {"loops": {"fit_loop": {
    ...     "epoch_loop.batch_progress": {"total": dict(batches), "current": dict(batches)},
    ...     "epoch_progress": {"total": dict(epochs), "current": dict(epochs)}}}}
    >>> progress.save(checkpoint)
    >>> checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]
    {'ready': 4, 'started': 4, 'processed': 4, 'completed': 3}
    >>> checkpoint["loops"]["fit_loop"]["epoch_progress"]["current"]
    {'ready': 1, 'started': 1, 'processed': 0, 'completed': 0}
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class IterationProgress:
    """The module's position in the current iteration.

    Args:
        optimizer_steps: optimizer steps per iteration (``IterationShape.optimizer_steps``).
    """

    optimizer_steps: int
    steps: int = 0  # optimizer steps taken in the current iteration
    since_step: int = 0  # micro-batches trained since the last optimizer step
    retake_snapshot: bool = False  # restored between iterations: θ_k is the policy, taken when training starts

    @property
    def inside(self) -> bool:
        """Some, not all, of the iteration's optimizer steps are taken: θ_k is no longer the policy."""
        return 0 < self.steps < self.optimizer_steps

    @property
    def unfinished(self) -> bool:
        """The iteration has started and not taken its last optimizer step."""
        return self.steps < self.optimizer_steps and (self.steps > 0 or self.since_step > 0)

    def start_iteration(self) -> None:
        self.steps, self.since_step = 0, 0

    def micro_batch(self) -> None:
        self.since_step += 1

    def optimizer_step(self) -> None:
        self.steps += 1
        self.since_step = 0

    def save(self, checkpoint: dict) -> None:
        checkpoint["lit_parl_progress"] = {"steps": self.steps, "inside": self.inside}
        if self.unfinished:
            self.rewind(checkpoint, self.since_step)

    def load(self, checkpoint: dict) -> None:
        saved = checkpoint.get("lit_parl_progress", {"steps": 0, "inside": False})
        self.since_step = 0
        self.steps = saved["steps"] if saved["inside"] else 0
        self.retake_snapshot = not saved["inside"]

    @staticmethod
    def rewind(checkpoint: dict, micro_batches: int) -> None:
        """Make Lightning's loop state in ``checkpoint`` that of an epoch stopped after its batch before the last
        ``micro_batches``, as if written there (``on_train_batch_end``), inside the epoch."""
        loops = checkpoint.get("loops")
        if loops is None:  # a weights-only checkpoint: nothing to resume
            return
        fit = loops["fit_loop"]
        batches = fit["epoch_loop.batch_progress"]
        done = batches["current"]["processed"] - micro_batches  # the micro-batches whose gradient the weights hold
        for key, value in (("ready", done), ("started", done), ("processed", done), ("completed", done - 1)):
            batches["total"][key] -= batches["current"][key] - value
            batches["current"][key] = value
        batches["is_last_batch"] = False
        # the epoch as started and not processed: also after a stop cut it (written at its end), and after a resume
        # from an epoch's last batch (Lightning then counts the next epoch as neither ready nor started)
        epochs = fit["epoch_progress"]
        epoch = epochs["current"]["completed"]
        for key, value in (("ready", epoch + 1), ("started", epoch + 1), ("processed", epoch), ("completed", epoch)):
            epochs["total"][key] += value - epochs["current"][key]
            epochs["current"][key] = value
