"""How people and programs reach hetspecd: the client library and the ``hetspec`` shell client.

Depends only on ``hetspec.protocol``; it talks to the daemon over its socket, never in-process.
"""
