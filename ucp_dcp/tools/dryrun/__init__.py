"""Know before a job starts whether a checkpoint loads at a target layout, and what it costs.

``python -m ucp_dcp plan CKPT --target ...`` (:mod:`ucp_dcp.tools.dryrun.command`) builds the target job's
state dict for every rank inside one CPU process (torch's fake process group, meta tensors), runs
the real ``UCPLoadPlanner`` validation and planning for each, the coordinator's checks and
read-once assignment over all, and reports every problem a real load would raise and, per rank,
the bytes, reads and files it would touch (see docs/plan.md).
"""

from .simulate import PlanReport, Problem, RankPlan, plan_load
from .targets import FunctionTarget, Target

__all__ = ["plan_load", "PlanReport", "Problem", "RankPlan", "Target", "FunctionTarget"]
