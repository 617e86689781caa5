"""Everything of the fleet of hosts (docs/fleet.md): the writer's replication
to NATS JetStream, the broker's bridge between hosts and their keys, the host
supervisor's status, control, placement, host-loss watch and adoption, and
`supervisor fleet`. Attached through named hooks only (broker/hooks.py,
actors/writer/hooks.py, supervisor/runtime/hooks.py): with `fleet.host` unset no
module here is imported. May import `broker`, `actors` and `supervisor`."""
