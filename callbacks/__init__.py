"""Lightning callbacks of lit_parl (imported as ``lit_parl.callbacks``)."""

from .hf_export import HFExport
from .pipeline_timeline import PipelineTimeline
from .run_summary import RunSummary
from .weight_sync import WeightSync

__all__ = ["HFExport", "PipelineTimeline", "RunSummary", "WeightSync"]
