"""Nodes: liveness from reports, fault history across jobs (reputation), quarantine recommendations."""
