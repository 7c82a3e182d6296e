"""The decoding modes a request may ask for, shared by the daemon and its clients.

"autoregressive": the target alone; "sequential": draft, then verify, the budget controller
choosing the shape unless the request fixes gamma; "parallel": the drafter drafts the next round
while the verifier verifies this one, at a fixed gamma; "adaptive": the controller chooses,
overlapped rounds included.
"""

MODES = ("autoregressive", "sequential", "parallel", "adaptive")
