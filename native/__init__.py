"""hetspec's native CPU kernels (C, in native/src) and the model they run.

Depends on nothing else of hetspec's: the workers use it, the daemon never imports it.
"""
