"""The prefix cache: `plan/` says what a prompt restores, `loader/` carries the plan out, `saver/` stores and
writes back, over `tiers/` every model shares, in units of `block/`; the engine's side is `interface.py`."""
