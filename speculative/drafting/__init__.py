"""Drafting's own algorithms: DuoDecoding's branching, EAGLE-2's dynamic tree, whether a draft's
vocabulary fits.
"""
