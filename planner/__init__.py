"""The planner: the end-to-end cost and memory model, the exact MILP policy search, baselines.

Imports hrm, never executor (docs/architecture.md). `predict` evaluates one given policy
(`predict_resident_run`: the one-device run of `hrm run --hardware`); `search` finds the best ones.
"""

from planner.evaluate import predict, predict_resident_run

__all__ = ["predict", "predict_resident_run"]
