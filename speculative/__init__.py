"""Pure speculative-decoding algorithms shared by the workers and the daemon.

Plain numpy functions and classes: token trees, sampling distributions, and (later) tree
verification and the budget controller. Nothing here imports torch, llama.cpp or any other
hetspec package, so every piece is testable without a model or a process.
"""
