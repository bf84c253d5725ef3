"""Jobs: registration, placement and launch."""
