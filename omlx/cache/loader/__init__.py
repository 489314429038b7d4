"""Carrying out a restore plan: reads and moves in bounded pieces, then the model's cache."""
