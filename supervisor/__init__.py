"""The process tree: child specs, restart policy, spawning, status and the
`supervisor` command line. May import `broker` and `actors`."""
