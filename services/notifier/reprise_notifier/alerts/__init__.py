"""Alerts: what an incident or recovery event says, remembered incidents, and the messages built from them."""
