"""executor: reads real Hugging Face MoE checkpoints and runs them (DESIGN.md, The executor).

Imports torch; imports hrm, never planner.
"""
