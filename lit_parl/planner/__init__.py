"""The capacity planner: a profiling run's phase costs (``phase_costs``), the iteration they predict for another
shape or split (``pipeline_model``), and the ``lit-parl-plan`` command (``plan_cli``). docs/planner.md."""

from lit_parl.planner.phase_costs import PhaseCosts, measure_costs
from lit_parl.planner.pipeline_model import Plan, Prediction, simulate

__all__ = ["PhaseCosts", "Plan", "Prediction", "measure_costs", "simulate"]
