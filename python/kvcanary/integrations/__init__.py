"""Integrations of kvcanary into real inference engines (each imports its engine lazily)."""
