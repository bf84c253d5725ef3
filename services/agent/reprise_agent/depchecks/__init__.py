"""Dependency checks: storage, disk, TCP and HTTP endpoints, and each running job's rendezvous master.

A node can be perfectly healthy while the things training needs are not: a checkpoint mount that hangs, a full
disk, an unreachable object store. ``specs`` holds what operators configure, ``probes`` how each kind is checked, and
``checker`` runs them, each with its own deadline so one hung dependency never stalls the others, reporting edges
(ok→failed, failed→ok) rather than levels so a broken mount does not flood the bus.
"""
