"""Small workloads for demos and tests (the PyTorch training job arrives with the demo issue)."""
