"""The CPU worker's engine: llama.cpp (through llama-cpp-python's low-level API).

``LlamaCppRuntime`` drafts (one branch or several, one batched decode per step) and verifies
token trees in one decode, encoding the tree with llama.cpp sequence ids.
"""

from hetspec.workers.runtimes.llama_cpp_runtime.runtime import LlamaCppError, LlamaCppRuntime
from hetspec.workers.runtimes.tree_runtime import DraftResult, RuntimeUsageError

__all__ = ["DraftResult", "LlamaCppError", "LlamaCppRuntime", "RuntimeUsageError"]
