"""The subagents host: isolated child agents whose work returns as a change set.

`python -m actors.subagents --state-dir D`, a broker peer named `subagents`.
docs/changesets.md is the normative text.
"""
