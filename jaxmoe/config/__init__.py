"""Configuration: defaults (defaults.py), config files and overrides (loading.py), validation
(validation.py)."""
