"""Nodes: the inventory built from agent reports."""
