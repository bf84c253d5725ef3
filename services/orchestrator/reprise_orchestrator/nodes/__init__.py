"""Nodes: cordons (an operator's, a recovery's, the detector's quarantine) and the node routes."""
