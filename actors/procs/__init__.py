"""The procs host: background commands and PTY terminals for every agent.

One process, a broker peer named `procs`; launch, registry, job, command,
terminal, facts, host, requests, client and ops each own one job.
docs/procs.md is the normative text.
"""
