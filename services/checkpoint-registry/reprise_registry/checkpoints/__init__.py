"""Checkpoints and their files: registration, commit, lookup."""
