"""Workloads: what requests arrive, when, and how long they are."""

from workloads.request import WorkloadRequest
from workloads.synthetic import SyntheticWorkload

WORKLOAD_TYPES = {"synthetic": SyntheticWorkload}

__all__ = ["WORKLOAD_TYPES", "SyntheticWorkload", "WorkloadRequest"]
