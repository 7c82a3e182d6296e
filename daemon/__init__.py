"""``hetspecd``: the supervisor daemon.

It spawns the CPU and GPU worker processes (``python -m hetspec.workers...``) and talks to them
through ``hetspec.protocol`` messages. It never imports ``hetspec.workers``, torch or llama.cpp:
a worker that crashes or hangs must not be able to take the daemon down with it.
"""
