"""ResumePoint: where a checkpoint left the current iteration, and what the resumed fit does about it.

A checkpoint written inside iteration k (at an optimizer step, or rewound to one by the module: see
``lit_parl.trainer.iteration_progress``) records how many of the iteration's micro-batches were trained. A fit resumed
from it regenerates iteration k from θ_k under version k (the same seeds: the same samples where the engine is
deterministic) and leaves those micro-batches out. Lightning resumes such a checkpoint inside the same epoch
(the module marks one written at the end of an epoch a stop cut, ``max_time``, as unfinished).

Example::

    >>> from lit_parl.data.rank_share import RankShare
    >>> from lit_parl.data.iteration_shape import IterationShape
    >>> share = RankShare(IterationShape(prompts=8, group_size=4, micro_batch_size=8, mini_batches=2))
    >>> point = ResumePoint()
    >>> point.load({"iterations_done": 3, "trained_in_iteration": 2, "world": 1}, share)
    >>> point.version, point.take_skip(None), point.take_skip(None)
    (3, 2, 0)
"""

from __future__ import annotations

from dataclasses import dataclass

from lit_parl.data.rank_share import RankShare


@dataclass
class ResumePoint:
    """The interrupted iteration a restored fit continues, if any."""

    trained: int = 0  # micro-batches of the interrupted iteration to leave out (this rank's)
    version: int | None = None  # the interrupted iteration's version (None: restored between iterations)
    restored: bool = False  # loaded from a checkpoint
    unchecked: bool = False  # Lightning's position not yet checked against this point (once, after a restore)

    @staticmethod
    def saved(trainer, share: RankShare, iterations_done: int) -> dict:
        """What a checkpoint written now records (every rank alike: their progress is the same)."""
        if trainer is None or iterations_done != trainer.current_epoch:
            return {"trained_in_iteration": 0, "world": share.world}  # between iterations
        processed = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        if processed >= share.local.micro_batches:
            # written as the fit ends (ModelCheckpoint's save_last): Lightning has counted the last iteration, whose
            # micro-batches are all trained, so current_epoch is already the next, which has not started
            return {"trained_in_iteration": 0, "world": share.world}
        per_step = share.local.micro_batches_per_pass // share.local.mini_batches
        # the micro-batches after the last optimizer step are not in the weights: they are trained again
        return {"trained_in_iteration": processed - processed % per_step, "world": share.world}

    def load(self, state: dict, share: RankShare) -> None:
        """Restore from ``state`` (a datamodule's checkpointed state)."""
        self.restored, self.trained, self.version, self.unchecked = True, 0, None, True
        trained = state.get("trained_in_iteration", 0)
        if not trained:
            return
        iterations_done = state["iterations_done"]
        if state.get("world", 1) != share.world:
            raise ValueError(
                f"this checkpoint was written inside iteration {iterations_done} by {state.get('world', 1)} rank(s), "
                f"and this fit has {share.world}: each rank's share of the iteration would differ. "
                "Resume inside an iteration with the same number of devices, "
                "or from a checkpoint written at an iteration's end (any number)."
            )
        self.trained, self.version = trained, iterations_done

    def take_skip(self, trainer) -> int:
        """The micro-batches the first iteration after the restore leaves out (once), checked first against
        Lightning's position in ``trainer``'s epoch (``None``: no trainer to check)."""
        if self.unchecked and trainer is not None:
            self.check_lightning(trainer.fit_loop.epoch_loop.batch_progress.current.ready)
        self.unchecked = False
        skip, self.trained = self.trained, 0
        return skip

    def check_lightning(self, lightning_trained: int) -> None:
        """Lightning's count of the epoch's trained batches at the stream's start must be what this point leaves out."""
        if lightning_trained != self.trained:
            raise RuntimeError(
                f"Lightning resumes this epoch after {lightning_trained} trained batches, but the checkpoint's data "
                f"position says {self.trained}: the checkpoint was written inside an iteration by a lit_parl version "
                "that did not record its position. Resume from a checkpoint written at an iteration's end "
                "(ModelCheckpoint(every_n_epochs=k))."
            )
