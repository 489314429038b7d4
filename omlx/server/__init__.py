"""server layer."""
