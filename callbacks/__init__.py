"""Lightning callbacks of lit_parl (imported as ``lit_parl.callbacks``), usable in any Lightning project.

What each needs from the module, the datamodule and the other callbacks is stated in
``lit_parl.callbacks.contracts`` and checked when fit starts.
"""

from .completion_samples import CompletionSamples, load_samples
from .contracts import (
    AdapterReceiver,
    HasPolicy,
    HasRolloutPool,
    HasTokenizer,
    IterationGate,
    IterationHistory,
    IterationRecord,
    SampleBatch,
    SampleRecord,
    SavesPretrained,
    SharedWeightReceiver,
    SyncTimes,
    TokenDecoder,
    TrainIntervals,
    WeightReceiver,
)
from .hf_export import HFExport
from .pipeline_timeline import PipelineTimeline, load_timeline
from .run_summary import RunSummary
from .weight_sync import WeightSync

__all__ = [
    "AdapterReceiver",
    "CompletionSamples",
    "HFExport",
    "HasPolicy",
    "HasRolloutPool",
    "HasTokenizer",
    "IterationGate",
    "IterationHistory",
    "IterationRecord",
    "PipelineTimeline",
    "RunSummary",
    "SampleBatch",
    "SampleRecord",
    "SharedWeightReceiver",
    "SavesPretrained",
    "SyncTimes",
    "TokenDecoder",
    "TrainIntervals",
    "WeightReceiver",
    "WeightSync",
    "load_samples",
    "load_timeline",
]
