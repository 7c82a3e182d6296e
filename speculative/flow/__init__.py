"""FlowSpec's pipeline: the continuously verified tree, each stage's cache, the layer split, the
pipeline's clock.
"""
