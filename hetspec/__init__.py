"""hetspec: heterogeneous CPU/GPU speculative decoding as a local daemon.

The sub-packages live in top-level folders of the repository and install here:

- ``hetspec.protocol``: typed messages between processes; depends on nothing of ours.
- ``hetspec.workers``: the CPU (llama.cpp) and GPU (torch) worker processes.
- ``hetspec.daemon``: ``hetspecd``, the supervisor that spawns the workers (it never imports them).
- ``hetspec.client``: the client library and the ``hetspec`` shell client.
- ``hetspec.models``: the bundled demo models.
"""

__version__ = "0.1.0"
