"""Engine pool: which models are loaded, loading them once, and (later) evicting them."""
