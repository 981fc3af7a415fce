"""The planner: the end-to-end cost and memory model, the exact MILP policy search, baselines.

Imports hrm, never executor (docs/architecture.md). `predict` evaluates one given policy
(`predict_resident_run`: the one-device run of `hrm run --hardware`); `search` finds the best ones.
"""

from planner.evaluate import predict, predict_resident_run, resident_run_memory

# Stamped on every prediction a RunRecord carries; bump it whenever the cost model changes what it
# predicts, so that `hrm report` never pools errors of two different models.
MODEL_VERSION = "2026-12-07.4"

__all__ = ["MODEL_VERSION", "predict", "predict_resident_run", "resident_run_memory"]
