"""Small worker-side commands the daemon runs in processes of their own: describe a model, probe a
runtime, profile a forward.
"""
