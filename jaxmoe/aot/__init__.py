"""Ahead of time: compile the real train step for a TPU topology on any host (compile_check.py)
and the topologies' compile-only devices (topologies.py)."""
