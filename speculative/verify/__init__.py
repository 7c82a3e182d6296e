"""Verification: token trees, the target's distributions, keyed and drawn sampling, verdicts."""
