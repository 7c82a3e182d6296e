"""The budget controller: what it measured, what a round of each shape is expected to cost, and the
plan it chooses.
"""
