"""cache layer."""
