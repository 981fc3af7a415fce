"""executor: reads real Hugging Face MoE checkpoints and runs them (docs/architecture.md).

Imports torch; imports hrm, never planner.
"""
