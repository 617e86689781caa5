"""The subagents host: isolated child agents whose work comes back as a
bounded change set (`python -m actors.subagents --state-dir D`, a broker
peer named `subagents`).

    children   the durable registry of children (what a restart resumes)
    host       spawn (snapshot, spec, child process), reap, build the change
               set, answer through the broker, apply once, recover
    starter    the child's process: forked by the host's zygote, or a fresh
               interpreter; held at a start gate until the registry has it
    __main__   the process: loop, request handlers, heartbeats with statistics
    ops        the agent ops (spawn_subagent, subagent_changes, apply_subagent)

A child is a real agent process (forked from the host's zygote, or `python -m
actors.agent`) running the same loop, gate and model code on a copy of its
parent's workspace, with its own stream `agent/<parent>.<id>`.
docs/changesets.md is the normative text.
"""
