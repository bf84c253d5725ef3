"""Proving a committed checkpoint intact: completeness, sizes, digests, DCP metadata."""
