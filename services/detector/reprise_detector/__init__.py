"""Reprise detector service."""
