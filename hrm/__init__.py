"""hrm: the shared vocabulary and the hierarchical roofline model.

Imports neither torch nor pulp (docs/architecture.md): the planner and the executor import hrm,
never the other way round.
"""

from hrm.errors import HrmError

__version__ = "0.1.0"
__all__ = ["HrmError", "__version__"]
