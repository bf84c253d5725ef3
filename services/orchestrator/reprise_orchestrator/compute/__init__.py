"""Compute backends: what runs the ranks (the platform's agents, or a cluster scheduler), behind one protocol
(backend.py); which one a replica uses is a setting (choose.py)."""
