"""The core-binding names under their old module, for notebook A1 (appendix), which imports them from here.

They live in ranks/cores.py; remove this module once A1 imports `ddp_helpers.ranks.cores`.
"""
from .cores import binding_plan, core_plan, cpu_budget, cpu_quota, usable_cores

__all__ = ["binding_plan", "core_plan", "cpu_budget", "cpu_quota", "usable_cores"]
