"""Incidents: one per fault per job, with the symptoms that explain it."""
