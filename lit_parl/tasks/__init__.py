"""Procedural tasks: prompt sources that make row ``i`` from their seed, with the reward that scores them.

- ``digits``: copy or reverse a digit string (the embedded default; learnable from random init on a CPU);
- ``countdown``: reach a target number with given numbers and + - * / (the expression parsed safely).
"""

from lit_parl.tasks.countdown import CountdownTask, countdown_reward
from lit_parl.tasks.digits import CopyTask, DigitTask, ReverseTask, positional_reward

__all__ = ["CopyTask", "CountdownTask", "DigitTask", "ReverseTask", "countdown_reward", "positional_reward"]
