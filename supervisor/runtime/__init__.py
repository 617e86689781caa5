"""The running supervisor: the loop, its children and their specs' argv, restart
policy, spawning, watching, the control socket, status publishing and `up`.

Nothing is imported here: a module that needs one part (the CLI reading
run/status.json) loads only that part. See docs/supervisor.md and
docs/architecture.md ("Layers").
"""
