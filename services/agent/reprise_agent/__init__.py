"""Reprise agent service."""
