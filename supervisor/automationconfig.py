"""The `automation:` section of the configuration: the operator's settings.

See docs/automation.md.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


class AutomationConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    enabled: bool = True  # run schedules and hooks in `supervisor up`
    tick_s: Annotated[float, Field(gt=0, le=60)] = 0.5  # schedules, streams: checked this often
    # a cron slot older than this when first seen was missed (the supervisor was
    # down): the schedule's `missed` policy applies; newer ones fire on time
    catchup_grace_s: Annotated[float, Field(gt=0, le=86400)] = 60.0
    # hosts a hook's url may name besides loopback (exact host names or addresses)
    hook_allow_hosts: list[Annotated[str, Field(min_length=1, max_length=253)]] = Field(
        default_factory=list, max_length=64)
