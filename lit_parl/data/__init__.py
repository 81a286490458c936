"""The trainer's data path, one part per job (see docs/design.md): ``IterationShape``, ``PromptSchedule``,
``VersionGate``, ``GroupScorer``, ``GroupAcceptor``, ``IterationBatcher``, ``IterationStats``."""

from lit_parl.data.group_acceptor import Advantages, GroupAcceptor
from lit_parl.data.group_scorer import GroupScorer
from lit_parl.data.iteration_batcher import IterationBatcher
from lit_parl.data.iteration_shape import IterationShape
from lit_parl.data.iteration_stats import IterationStats
from lit_parl.data.prompt_schedule import PromptSchedule
from lit_parl.data.version_gate import VersionGate
from lit_parl.errors import OffPolicyError

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
