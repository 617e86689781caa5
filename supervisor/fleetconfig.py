"""The `fleet:` section of the configuration: this host and its NATS cluster.

With `host` unset the runtime is one host on its own. Credentials are paths,
never in argv or a log. See docs/fleet.md ("Set-up").
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

HostName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class FleetTls(_Strict):
    ca: str | None = None
    cert: str | None = None
    key: str | None = None


# The fleet's hooks (broker/hooks.py), named here and imported only by the
# processes started with them: with `fleet.host` unset no fleet module loads.
WRITER_HOOK = "supervisor.fleet.replicate"
BROKER_HOOK = "supervisor.fleet.bridge"
OPERATOR_KEY_ENV = "CORRAL_OPERATOR_KEY"  # the operator's private key file (never a host's)


class FleetConfig(_Strict):
    host: HostName | None = None  # None: fleet mode off
    urls: list[Annotated[str, Field(pattern=r"^(nats|tls)://[^@/\s]+$")]] = Field(
        default_factory=list)
    creds: str | None = None
    nkey_seed: str | None = None
    tls: FleetTls = FleetTls()
    replicas: Annotated[int, Field(ge=1, le=5)] = 3
    publish_timeout_s: Annotated[float, Field(gt=0, le=60)] = 2.0
    host_ttl_s: Annotated[float, Field(ge=1, le=3600)] = 10.0  # a silent host's entry expires
    dead_grace_s: Annotated[float, Field(ge=0, le=3600)] = 5.0  # then, this long: dead, fenced
    operator_public_key: str | None = None  # the operator's Ed25519 public key (a file)
    bus_secret: str | None = None  # the hosts' shared secret (a file): bus frames' MAC
    max_agents: Annotated[int, Field(ge=0)] = 0  # placement: a host this full declines; 0: no cap
    # an agent's subagent may run on another host, and this host runs other hosts'
    # (docs/fleet.md, "Subagents on another host"); off: every child runs here
    remote_subagents: bool = False

    @model_validator(mode="before")
    @classmethod
    def _no_shared_operator_key(cls, data: Any) -> Any:
        if isinstance(data, dict) and "operator_key" in data:
            if data["operator_key"] is not None:
                raise ValueError(
                    "fleet.operator_key (one secret shared by the operator and every host) "
                    "is no longer accepted: a host holds fleet.operator_public_key (the "
                    "operator's Ed25519 public key) and fleet.bus_secret (the hosts' bus "
                    "secret); the operator signs with the private key CORRAL_OPERATOR_KEY "
                    "names (`supervisor fleet up` makes them; docs/fleet.md)")
            data = {k: v for k, v in data.items() if k != "operator_key"}
        return data

    @field_validator("urls")
    @classmethod
    def _no_secrets(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if "@" in url:
                raise ValueError("a fleet URL may not carry credentials: use creds")
        return urls

    @model_validator(mode="after")
    def _urls_with_host(self) -> FleetConfig:
        if self.host is not None and not self.urls:
            raise ValueError("fleet.host is set: fleet.urls must name the cluster")
        return self

    @property
    def enabled(self) -> bool:
        return self.host is not None

    def secret_paths(self, env: Mapping[str, str] | None = None) -> list[str]:
        """The credential files this host holds (absolute): hidden from every
        command's sandbox, since they lie wherever the operator put them (the
        operator's public key is public: not listed). Also the operator's
        private key when the supervisor's environment names it (`env`, default
        os.environ): a machine that is both a host and the operator's."""
        env = os.environ if env is None else env
        operator = env.get(OPERATOR_KEY_ENV)
        paths = [operator] if operator else []
        if self.host is not None:
            paths += [p for p in (self.creds, self.nkey_seed, self.tls.key, self.bus_secret) if p]
        return [os.path.abspath(path) for path in paths]

    def writer_args(self) -> list[str]:
        """The writer's replication hook and its `--fleet-*` options (paths
        only, never a secret)."""
        if self.host is None:
            return []
        return ["--hook", WRITER_HOOK, "--fleet-replicas", str(self.replicas),
                "--fleet-publish-timeout-s", str(self.publish_timeout_s), *self._cluster_args()]

    def broker_args(self) -> list[str]:
        """The broker's: its bridge to other hosts (supervisor/fleet/bridge.py), which signs
        frames with a key derived from the hosts' bus secret and takes the
        operator's `forget-bus-key` (paths, never a key)."""
        if self.host is None:
            return []
        key = ["--fleet-bus-secret", self.bus_secret] if self.bus_secret else []
        if self.operator_public_key:
            key += ["--fleet-operator-public-key", self.operator_public_key]
        return ["--hook", BROKER_HOOK, *self._cluster_args(), *key,
                "--fleet-view-interval-s", str(min(1.0, self.host_ttl_s / 3))]

    def subagents_args(self) -> list[str]:
        """The subagents actor's: this host's name, and whether children cross hosts."""
        if self.host is None:
            return []
        return ["--fleet-host", self.host, *(["--remote-subagents"] if self.remote_subagents
                                             else [])]

    def _cluster_args(self) -> list[str]:
        assert self.host is not None
        args = ["--fleet-host", self.host]
        for url in self.urls:
            args += ["--fleet-url", url]
        for flag, value in (("--fleet-creds", self.creds), ("--fleet-nkey", self.nkey_seed),
                            ("--fleet-tls-ca", self.tls.ca), ("--fleet-tls-cert", self.tls.cert),
                            ("--fleet-tls-key", self.tls.key)):
            if value is not None:
                args += [flag, value]
        return args
