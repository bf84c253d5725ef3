"""The kubernetes compute backend (backend.py): Reprise's agents run the ranks in pods, Kubernetes owns the nodes.
The API server is reached through one typed adapter (api.py, on the official client's asyncio twin); a cordon's
patches are computed from the node as read (cordon.py); the nodes are kept current by a list and a watch (nodes.py)
whose condition changes become signals (signals.py); the least privilege the backend needs is data (rbac.py); a
job's `kubernetes` section and the operator's allow-list it must stay inside are models.py."""
