"""The planner: writer and reader layouts in, a deterministic list of transfer ops out.

Pure: no process groups, transports or engines are imported here.
"""

from weightsync.plan.balance import send_lower_bound, water_fill
from weightsync.plan.ops import OpColumns, Plan, PlanStats, Role, TransferOp
from weightsync.plan.phases import layer_index, layer_phases, split_plan
from weightsync.plan.planner import (
    PLANNER_VERSION,
    PlanError,
    PlanOptions,
    build_local_plan,
    build_plan,
    plan_statistics,
)

__all__ = [
    "PLANNER_VERSION",
    "OpColumns",
    "Plan",
    "PlanError",
    "PlanOptions",
    "PlanStats",
    "Role",
    "TransferOp",
    "build_local_plan",
    "build_plan",
    "layer_index",
    "layer_phases",
    "plan_statistics",
    "send_lower_bound",
    "split_plan",
    "water_fill",
]
