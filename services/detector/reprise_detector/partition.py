"""Scale-out: which jobs and nodes this replica owns, and the durable consumer names that go with its partition.

Every replica reads every agent message (each through its own durable consumer) and keeps per-node liveness for all
nodes, which is cheap; only the owner of a job correlates, persists and publishes for it, so two replicas never
open an incident for the same job. A symptom that hits no placed job belongs to the owner of its node.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass


def partition_of(key: str, count: int) -> int:
    """The partition a job or node id falls in: a stable hash (CRC-32), the same in every replica and release."""
    return zlib.crc32(key.encode()) % count


@dataclass(frozen=True)
class Partition:
    """This replica's share: index out of count."""

    index: int = 0
    count: int = 1

    def owns_job(self, job_id: str) -> bool:
        """True when this replica correlates the job's symptoms."""
        return self.count == 1 or partition_of(job_id, self.count) == self.index

    def owns_node(self, node_id: str) -> bool:
        """True when this replica handles a node's symptoms that hit no placed job."""
        return self.count == 1 or partition_of(node_id, self.count) == self.index

    def durable(self, base: str) -> str:
        """The durable consumer name for this partition; the plain base name when there is one replica."""
        return base if self.count == 1 else f"{base}-p{self.index}of{self.count}"
