"""Reprise orchestrator service."""
