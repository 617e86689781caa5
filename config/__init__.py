"""Default configuration and example task files (data, no logic). Installed as the
package data `supervisor.defaults` (pyproject.toml); never imported as `config`."""
