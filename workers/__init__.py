"""The worker processes: the CPU worker (llama.cpp via llama-cpp-python) and the GPU worker
(torch, CUDA when present). Each runs as its own process, spawned by the daemon, and depends on
``hetspec.protocol`` only, never on ``hetspec.daemon``.
"""
