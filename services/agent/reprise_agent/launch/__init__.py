"""Rank launching: the Launcher protocol (base) and its implementations (processes, with warm standbys)."""
