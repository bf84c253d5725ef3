"""Reprise dashboard service."""
