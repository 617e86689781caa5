"""Default configuration and example task files (data, no logic)."""
