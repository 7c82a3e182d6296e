"""The engines a worker process hosts: llama.cpp, hetspec's native kernels, torch; and what they
share.
"""
