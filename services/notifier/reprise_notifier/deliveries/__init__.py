"""Deliveries: the outbox, one worker per destination (pacing, coalescing, retries), dead letters."""
