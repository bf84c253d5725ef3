"""Reprise checkpoint registry service."""
