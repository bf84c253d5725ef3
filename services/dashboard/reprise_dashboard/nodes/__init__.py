"""Nodes: per-GPU health, cordons and reputation."""
