"""Alerts: the notifier's dead letters and destinations."""
