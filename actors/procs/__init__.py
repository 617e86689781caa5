"""The procs host: background commands and PTY terminals for every agent.

One process (`python -m actors.procs --state-dir D`), a broker peer named
`procs`. Modules, one job each:

    launch     fork/exec in a new session behind a start gate (no pid escapes
               the registry), PTY set-up, group signals and the marker sweep
    registry   the small durable file of what was started (pid, start time, log)
    job        what commands and terminals share: log reads by cursor, kills
    command    one background command: wrapper, exit file, cap, lifetime
    terminal   one PTY program: pump to the log, input, cap, lifetime
    facts      the WAL events (proc_*, terminal_*) through the writer
    host       the loop's state: starting, reaping, recovery, deferred replies
    requests   one handler per procs message
    client     the agent side: typed calls over a BrokerPeer
    ops        the agent ops (bash, bash_*, terminal_*) in the agent's op union

docs/procs.md is the normative text.
"""
