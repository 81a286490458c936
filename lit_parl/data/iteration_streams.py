"""The datasets Lightning's loops read: the current iteration's micro-batches, and the held-out evaluation's metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.utils.data import IterableDataset

if TYPE_CHECKING:
    from lit_parl.data.rollout_datamodule import RolloutDataModule


class IterationStream(IterableDataset):
    """The micro-batches of the datamodule's current iteration, started when its gate opened.

    Sized, so Lightning does not prefetch, knows the last micro-batch and never resumes the stream after it:
    the iteration is booked just before that one leaves, when the batcher is done with the pool. A fit resumed
    inside an iteration regenerates it from θ_k with the same seeds (the same samples) and leaves out the
    micro-batches trained before the checkpoint.
    """

    def __init__(self, datamodule: RolloutDataModule) -> None:
        self.datamodule = datamodule

    def __len__(self) -> int:
        return self.datamodule.share.local.micro_batches

    def __iter__(self):
        data = self.datamodule
        started = data.start.take()  # waits at the version gate
        total, count = len(self), 0
        skip = data.resume.take_skip(data.trainer)
        try:
            for batch in started.batches:
                count += 1
                if count == total:
                    data.finish_iteration(started.stats)
                if count <= skip:
                    continue
                if data.cores is not None:  # here, on the trainer's thread: threads are set per calling thread
                    lent = data.cores.follow(started.stats) > data.cores.trainer_threads
                    if lent and started.stats.lent_from is None:
                        started.stats.lent_from = count - 1
                yield batch
                if count == total:
                    return
        finally:
            started.batches.close()  # also stops the prefetch thread when the fit fails mid-iteration
        raise RuntimeError(f"iteration {data.iterations_done} produced {count} of its {total} micro-batches")


class EvalStream(IterableDataset):
    """One evaluation's metrics when the iteration just trained is due for one; nothing otherwise."""

    def __init__(self, datamodule: RolloutDataModule) -> None:
        self.datamodule = datamodule

    def __iter__(self):
        metrics = self.datamodule.evaluate()
        if metrics:
            yield metrics
