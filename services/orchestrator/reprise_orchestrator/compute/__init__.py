"""Compute backends: what runs the ranks (the platform's agents, or a cluster scheduler), behind one protocol
(backend.py; allocation.py for a scheduler that allocates the nodes). Each backend is a package (agents/, slurm/);
which one a replica uses is a setting (choose.py)."""
