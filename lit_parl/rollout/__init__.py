from lit_parl.rollout.hf_pool import HFRolloutPool
from lit_parl.rollout.pool_records import PoolHealth, PoolSpec
from lit_parl.rollout.rollout_pool import RolloutPool
from lit_parl.rollout.sglang import SGLangRolloutPool

__all__ = ["HFRolloutPool", "PoolHealth", "PoolSpec", "RolloutPool", "SGLangRolloutPool", "VLLMRolloutPool"]


def __getattr__(name: str):
    # lazy, so that importing lit_parl.rollout never depends on the optional vLLM backend
    if name == "VLLMRolloutPool":
        from lit_parl.rollout.vllm_pool import VLLMRolloutPool

        return VLLMRolloutPool
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
