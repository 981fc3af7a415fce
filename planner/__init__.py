"""The planner: the end-to-end cost and memory model, the exact MILP policy search, baselines.

Imports hrm, never executor (DESIGN.md). `predict` evaluates one given policy; `search` finds the
best ones.
"""

from planner.evaluate import predict

__all__ = ["predict"]
