"""FlowSpec's pipeline inside hetspecd: stage processes verify, the CPU worker's draft model
drafts.
"""
