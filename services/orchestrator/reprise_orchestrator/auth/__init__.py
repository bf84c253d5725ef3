"""API keys with scopes (read < operate < admin) and the audit record of every mutating call."""
