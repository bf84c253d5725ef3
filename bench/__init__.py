"""Benchmarks: each prints its figures and saves them as JSON under bench/results/; none asserts a timing."""
