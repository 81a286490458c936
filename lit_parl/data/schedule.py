"""PromptSchedule: which prompts an iteration draws, their tokens and their per-sample seeds.

Prompt ``i`` of the run is ``task.make(i)``; ``prompt_id`` is that global draw index, never reused,
so results are paired with requests by id and a resumed run continues where it stopped. The cursor
(the next prompt to draw) is the schedule's only state and is checkpointed with the datamodule.

Example::

    >>> from lit_parl.tasks import CopyTask
    >>> from lit_parl.tokenizer import build_char_tokenizer
    >>> schedule = PromptSchedule(CopyTask(seed=0), build_char_tokenizer(), group_size=2, seed=0)
    >>> requests = schedule.requests([0, 1], version=3)
    >>> sorted(requests), requests[0].version, len(requests[0].seeds)
    ([0, 1], 3, 2)
    >>> schedule.advance(2); schedule.state_dict()
    {'cursor': 2}
"""

from __future__ import annotations

import threading

from transformers import PreTrainedTokenizerBase

from lit_parl.trajectory import GroupRequest, sample_seed


class PromptSchedule:
    """The run's prompt order, tokenization (with a cache filled ahead) and sample seeds.

    Args:
        task: makes prompt ``i``: ``task.make(i) -> (prompt text, answer text)``.
        tokenizer: encodes prompt and answer (no special tokens added).
        group_size: samples per prompt, hence seeds per request.
        seed: the run's seed; sample ``k`` of prompt ``i`` under policy version ``v`` draws from
            ``sample_seed(seed, v, i, k)``, so a completion never depends on what shared its batch.
    """

    def __init__(self, task, tokenizer: PreTrainedTokenizerBase, group_size: int, seed: int = 0) -> None:
        self.task = task
        self.tokenizer = tokenizer
        self.group_size = group_size
        self.seed = seed
        self.cursor = 0  # the next prompt to draw
        self._tokenized: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}  # prompt_id -> (prompt, answer) tokens
        self._lock = threading.RLock()  # a prefetch thread tokenizes ahead while the trainer's thread requests

    def advance(self, drawn: int) -> None:
        """Move the cursor past an iteration's ``drawn`` prompts (called once the iteration is complete)."""
        self.cursor += drawn

    def tokenize_ahead(self, prompt_ids: list[int]) -> None:
        """Tokenize these prompts (and answers) now, in one batched call; ``requests`` takes them from here."""
        with self._lock:  # held throughout: a concurrent ``requests`` waits for this work instead of redoing it
            missing = [prompt_id for prompt_id in prompt_ids if prompt_id not in self._tokenized]
            if not missing:
                return
            texts = [self.task.make(prompt_id) for prompt_id in missing]
            encoded = self.tokenizer([t for pair in texts for t in pair], add_special_tokens=False).input_ids
            for i, prompt_id in enumerate(missing):
                self._tokenized[prompt_id] = (tuple(encoded[2 * i]), tuple(encoded[2 * i + 1]))

    def requests(self, prompt_ids: list[int], version: int) -> dict[int, GroupRequest]:
        """The requests for these prompts under policy ``version``, by prompt_id."""
        with self._lock:
            self.tokenize_ahead(prompt_ids)
            tokens = {prompt_id: self._tokenized.pop(prompt_id) for prompt_id in prompt_ids}
        return {
            prompt_id: GroupRequest(
                prompt_id=prompt_id,
                prompt_tokens=tokens[prompt_id][0],
                answer_tokens=tokens[prompt_id][1],
                version=version,
                seeds=tuple(sample_seed(self.seed, version, prompt_id, k) for k in range(self.group_size)),
            )
            for prompt_id in prompt_ids
        }

    def state_dict(self) -> dict:
        return {"cursor": self.cursor}

    def load_state_dict(self, state_dict: dict) -> None:
        with self._lock:
            self.cursor = state_dict["cursor"]
            self._tokenized.clear()  # tokenized for the old cursor: may never be requested
