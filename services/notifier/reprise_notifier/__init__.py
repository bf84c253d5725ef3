"""Reprise notifier service."""
