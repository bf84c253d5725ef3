"""Recoveries: the exactly-once recovery state machine."""
