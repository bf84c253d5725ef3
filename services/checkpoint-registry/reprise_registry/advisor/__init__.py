"""Checkpoint-interval advice (Young/Daly) and expected ETTR."""
