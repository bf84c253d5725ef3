"""Incidents: the filtered list and one incident with its evidence."""
