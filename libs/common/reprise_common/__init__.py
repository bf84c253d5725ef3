"""Reprise shared library: the contract and plumbing every service uses."""
