"""The worker processes as the daemon sees them: spawned, handshaken, called, kept up; their cores
and arena slots.
"""
