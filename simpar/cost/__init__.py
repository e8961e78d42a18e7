"""simpar.cost: what drives training time, computed from shapes alone (no MPI, no data).

Today: a collective's traffic and alpha-beta time (:mod:`simpar.cost.collective`), the single
owner of those formulas. Device profiles, op and memory costs come with the cost-model issue.
"""

from simpar.cost.collective import (
    ALPHA_SECONDS,
    BANDWIDTH_BYTES_PER_S,
    latency_rounds,
    sample_ranks,
    seconds,
    traffic,
)

__all__ = ["ALPHA_SECONDS", "BANDWIDTH_BYTES_PER_S", "latency_rounds", "sample_ranks", "seconds",
           "traffic"]
