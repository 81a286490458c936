"""Workload (b) of ``benchmarks/vs_trl/vs_trl.py``: the copy task with a long shared preamble.

``PreambleCopyTask`` is ``lit_parl.tasks.CopyTask`` with a fixed instruction text of ``preamble_chars``
characters (one token each with the character tokenizer) put before every prompt. The answer and the
reward are unchanged. Both sides import this one class (``PYTHONPATH=benchmarks/vs_trl``), so the prompts,
answers and reward are the same on both:

- lit_parl: ``lit-parl data._target_=vs_trl_task.PreambleCopyTask``. Hydra instantiates the class, and the
  rollout workers unpickle it by reference.
- TRL: ``benchmarks/vs_trl/trl_side.py --task preamble``.

Example::

    >>> task = PreambleCopyTask(preamble_chars=200, seed=0)
    >>> prompt, answer = task.make(0)
    >>> len(prompt) - len(answer) - 1
    200
    >>> prompt.endswith(answer + "=")
    True
"""

from __future__ import annotations

from dataclasses import dataclass

from lit_parl.models.char_tokenizer import CHARACTERS
from lit_parl.tasks import CopyTask

# Only characters of lit_parl's character tokenizer, and no "=" (it marks the end of the digits).
INSTRUCTION = (
    "you are a careful copying assistant. read the digits that come after this text and before the equals "
    "sign, then write exactly the same digits again, in the same order, and stop at once. do not add spaces, "
    "words, signs or extra digits; do not reverse, sort or change them. the answer is short: two to four "
    "digits. "
)


def preamble(chars: int) -> str:
    """The instruction text, repeated or cut to exactly ``chars`` characters."""
    text = INSTRUCTION * (chars // len(INSTRUCTION) + 1)
    return text[:chars]


@dataclass
class PreambleCopyTask(CopyTask):
    """``<preamble><digits>=`` → ``<digits>``; the preamble is the same for every prompt."""

    preamble_chars: int = 200

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.preamble_chars < 0:
            raise ValueError(f"preamble_chars must be >= 0, got {self.preamble_chars}")
        bad = set(INSTRUCTION) - set(CHARACTERS)
        if bad or "=" in INSTRUCTION:
            raise ValueError(f"the preamble uses characters outside the tokenizer's: {sorted(bad)}")
        self._preamble = preamble(self.preamble_chars)

    def make(self, index: int) -> tuple[str, str]:
        prompt, answer = super().make(index)
        return self._preamble + prompt, answer
