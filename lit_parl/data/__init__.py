"""The trainer's data path, one part per job (see docs/design.md): ``IterationShape``, ``PromptSchedule``,
``VersionGate``, ``GroupScorer``, ``GroupAcceptor``, ``IterationBatcher``, ``IterationStats``."""

from lit_parl.data.acceptor import Advantages, GroupAcceptor
from lit_parl.data.batcher import IterationBatcher
from lit_parl.data.gate import OffPolicyError, VersionGate
from lit_parl.data.schedule import PromptSchedule
from lit_parl.data.scoring import GroupScorer
from lit_parl.data.shape import IterationShape
from lit_parl.data.stats import IterationStats

__all__ = [
    "Advantages",
    "GroupAcceptor",
    "GroupScorer",
    "IterationBatcher",
    "IterationShape",
    "IterationStats",
    "OffPolicyError",
    "PromptSchedule",
    "VersionGate",
]
