"""The built-in compute backend: the platform's own agents, one per node, commanded over NATS (backend.py)."""
