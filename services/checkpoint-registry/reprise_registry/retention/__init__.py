"""Which validated checkpoints to keep, and pins that keep one while a recovery uses it."""
