"""The reprise command line: local stack, fault injection, jobs."""
