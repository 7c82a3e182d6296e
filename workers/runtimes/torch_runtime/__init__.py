"""The GPU worker's engine: a compact torch runtime for Llama-family models.

``TorchRuntime`` loads a Hugging Face model folder and evaluates token trees against a
preallocated KV cache: verify a whole drafted tree in one forward, keep the accepted path,
roll back, or draft branches itself (the Dovetail placement).
"""

from hetspec.workers.runtimes.torch_runtime.config import ModelConfig, ModelLoadError
from hetspec.workers.runtimes.torch_runtime.runtime import TorchRuntime, TreeOutput
from hetspec.workers.runtimes.tree_runtime import DraftResult, RuntimeUsageError

__all__ = [
    "DraftResult",
    "ModelConfig",
    "ModelLoadError",
    "RuntimeUsageError",
    "TorchRuntime",
    "TreeOutput",
]
