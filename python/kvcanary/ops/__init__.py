"""Canary operations: each module holds the torch reference next to its native wrapper."""
