"""Every benchmark of hetspec, in one home: ``hetspec bench`` (compare.py) and the micro-benchmarks.

Benchmarks may import anything of hetspec (and torch, llama.cpp); nothing of the product imports
them, except the shell client, whose ``hetspec bench`` command is compare.py's front door.
"""
