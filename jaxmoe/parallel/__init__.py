"""Device meshes (mesh.py), logical-axis sharding rules (sharding.py), multi-process start-up
(distributed.py), accelerator facts (chips.py) and device-memory checks (device_memory.py)."""
