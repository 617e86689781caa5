"""The procs host: background commands and PTY terminals for every agent.

One process (`python -m actors.procs --state-dir D`), a broker peer named
`procs`. Modules, one job each:

    launch     fork/exec in a new session behind a start gate (no pid escapes
               the registry), PTY set-up, group signals and the marker sweep
    registry   the small durable file of what was started (pid, start time, log)
    command    one background command: wrapper, exit file, cap, lifetime, reads
    terminal   one PTY program: pump to the log, input, cap, lifetime, reads
    facts      the WAL events (proc_*, terminal_*) through the writer
    host       the loop: requests, deferred replies, reaping, recovery, status

docs/procs.md is the normative text.
"""
