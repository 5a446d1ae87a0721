"""Warm worlds: one set of ranks serving many tests, as good as new."""
