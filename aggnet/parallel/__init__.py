"""Model-parallel stages with data-parallel groups placed by topology.

Sending less across the slow links by splitting the model (hybrid model
parallelism and all-reduce): cut a layer chain into pipeline stages
(:func:`partition`, exact dynamic programming), place the stages and their
copies on the racks of a topology (:func:`build_layout`), weigh the
placements against data parallelism by the bytes they put on the uplinks
(:func:`plan`, ``aggnet plan``), and train (:class:`HybridParallel`:
torch's pipeline schedules, each stage's gradients through aggnet).
docs/parallel.md says which placement to use when.
"""

from aggnet.parallel.cost import Links, PlanResult, plan
from aggnet.parallel.layout import PLACEMENTS, GroupJob, Layout, LayoutError
from aggnet.parallel.layout import build as build_layout
from aggnet.parallel.partition import Partition, PartitionError, partition
from aggnet.parallel.profile import Profile, profile

__all__ = ["PLACEMENTS", "GroupJob", "HybridParallel", "Layout", "LayoutError", "Links", "Partition",
           "PartitionError", "PlanResult", "Profile", "build_layout", "partition", "plan", "profile"]


def __getattr__(name):
    # the trainer needs torch; the planner does not
    if name == "HybridParallel":
        from aggnet.parallel.hybrid import HybridParallel

        return HybridParallel
    raise AttributeError(f"module 'aggnet.parallel' has no attribute {name!r}")
