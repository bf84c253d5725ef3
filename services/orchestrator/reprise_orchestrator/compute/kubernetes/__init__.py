"""The kubernetes compute backend (backend.py): Reprise's agents run the ranks in pods, Kubernetes owns the nodes.
The API server is reached through one typed adapter (api.py, on the official client's asyncio twin); a cordon's
patches are computed from the node as read (cordon.py); the nodes (nodes.py) and the jobs' pods (podwatch.py) are kept
current by one list-and-watch (watch.py) whose changes become signals (signals.py, pods.py); a job's allocation is
its pods, one per node, each running that node's agent (jobpods.py, pods.py); the least privilege the backend needs
is data (rbac.py); a job's `kubernetes` section and the operator's allow-list it must stay inside are models.py."""
