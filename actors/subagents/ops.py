"""The agent ops `spawn_subagent`, `subagent_changes` and `apply_subagent`.

`apply_subagent` is not `replay_safe`; the other two are.
See docs/changesets.md ("The host and the ops").
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from actors.changesets.confined import NO_GUARD
from actors.kernel import workspace
from actors.kernel.ops import Done, OpBase, OpContext, OpSpec, Outcome
from broker import protocol
from broker.errors import PathRefusedError, RemoteError, RequestTimeoutError
from broker.requester import new_msg_id
from broker.statedir import StateDir

SUBAGENTS = "subagents"
SubagentIdField = Annotated[str, Field(pattern=r"^(s-[0-9a-f]{12}|latest)$")]  # latest: newest
REPLY_MARGIN_S = 10.0
SPAWN_ROUND_S = 5.0  # a spawn waits for its child in rounds this long
# The supervisor restarts a crashed host within about a second; while it is
# away the broker answers unknown_recipient, which the peer retries after a
# heartbeat interval: this many retries ride out a restart.
HOST_RESTART_RETRIES = 20


def _summary(ctx: OpContext, reply: protocol.SubagentReply, *,
             with_patch: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"subagent_id": reply.subagent_id, "state": reply.state,
                           "exit_code": reply.exit_code}
    if reply.manifest is not None:
        manifest = json.loads(reply.manifest)
        out["status"] = manifest["status"]
        out["files"] = [{"path": f["path"], "op": f["op"]} for f in manifest["files"]][:64]
        out["refusal"] = manifest.get("refusal")
        out["patch_bytes"] = manifest["patch_bytes"]
    if with_patch and reply.patch is not None:
        text = reply.patch.decode("utf-8", "replace")
        out["patch"] = text[: ctx.max_result_chars]
        out["patch_truncated"] = len(text) > ctx.max_result_chars
    if reply.receipt is not None:
        out["applied"] = True
    if reply.refusal is not None:
        out["error"] = reply.refusal
    return out


def _request(
    ctx: OpContext, message: protocol.Message, timeout_s: float, retries: int = 1
) -> Outcome | protocol.SubagentReply:
    peer = getattr(ctx, "peer", None)
    if peer is None:
        return Done({"error": "subagents is not reachable: no broker connection"}, ok=False)
    try:
        reply = peer.request(SUBAGENTS, message, timeout_s=timeout_s, retries=retries)
    except RemoteError as exc:
        return Done({"error": f"{exc.code}: {exc.detail}"[:500]}, ok=False)
    except RequestTimeoutError:
        return Done({"error": "subagents did not answer"}, ok=False)
    if not isinstance(reply, protocol.SubagentReply):
        return Done({"error": f"unexpected reply {reply.kind}"}, ok=False)
    return reply


class SpawnSubagentOp(OpBase):
    """Run a child agent on a task file in an isolated copy of the workspace; get its changes."""

    op: Literal["spawn_subagent"] = "spawn_subagent"
    task: Annotated[str, Field(min_length=1, max_length=4096)]
    descriptor: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_\-]{0,31}$")] = "child"
    wait_s: Annotated[float, Field(gt=0, le=3600)] = 600.0
    # fleet mode: the host the child runs on (docs/fleet.md); absent: this host
    host: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")] | None = None
    command_field: ClassVar[str | None] = "task"
    replay_safe: ClassVar[bool] = True

    def deadline_s(self, ctx: OpContext) -> float:
        # the wait, then one last round riding out a host restart
        return self.wait_s + (SPAWN_ROUND_S + REPLY_MARGIN_S) * (HOST_RESTART_RETRIES + 1)


class SubagentChangesOp(OpBase):
    """Show a child's change set (manifest and patch)."""

    op: Literal["subagent_changes"] = "subagent_changes"
    subagent_id: SubagentIdField
    replay_safe: ClassVar[bool] = True
    call_deadline_s: ClassVar[float] = 10.0 * (HOST_RESTART_RETRIES + 1)


class ApplySubagentOp(OpBase):
    """Apply a child's ready change set to the workspace (once; refused if files changed)."""

    op: Literal["apply_subagent"] = "apply_subagent"
    subagent_id: SubagentIdField
    call_deadline_s: ClassVar[float] = 30.0 * (HOST_RESTART_RETRIES + 1)


def task_path(ws: Path, task: str, state_dir: StateDir | None = None) -> str:
    """The task file the child runs, inside the parent's workspace: the model
    names it, so it must not reach a file the agent was never given
    (PathRefusedError when it escapes: `..`, an absolute path elsewhere, a
    symlink, `~`, or the state directory when `state_dir` is given)."""
    if os.path.isabs(task):
        inside = os.path.normpath(task)
        roots = [r for r in (os.path.normpath(ws), str(ws.resolve()))
                 if inside != r and os.path.commonpath([r, inside]) == r]
        if not roots:
            raise PathRefusedError(task, "a task file outside the workspace")
        task = os.path.relpath(inside, roots[0])
    guard = workspace.guard_for(state_dir) if state_dir is not None else None
    return str(workspace.resolve(ws, task, write=False, guard=guard or NO_GUARD))


def spawn_subagent(op: SpawnSubagentOp, ctx: OpContext) -> Outcome:
    """Ask the host for the child and wait for it in short rounds: each round
    is a spawn with the same key (the host answers with the existing child),
    so a host restarted meanwhile, or this agent redoing the call after a
    crash, finds the same child instead of starting another."""
    task = task_path(ctx.workspace, op.task, ctx.state_dir)
    key = f"{ctx.agent}.{ctx.call_id}" if ctx.call_id else None
    deadline = time.monotonic() + op.wait_s
    while True:
        wait_s = max(0.0, min(SPAWN_ROUND_S, deadline - time.monotonic()))
        message = protocol.SpawnSubagent(msg_id=new_msg_id("sa"), parent=ctx.agent,
                                         workspace=str(ctx.workspace.resolve()), task=task,
                                         descriptor=op.descriptor, wait_s=wait_s, key=key,
                                         host=op.host)
        reply = _request(ctx, message, wait_s + REPLY_MARGIN_S, retries=HOST_RESTART_RETRIES)
        if not isinstance(reply, protocol.SubagentReply):
            return reply
        if reply.state != "running" or key is None or time.monotonic() >= deadline:
            break
    facts = []
    if reply.state != "running":
        facts.append(("subagent_usage", {"subagent_id": reply.subagent_id,
                                         "tokens": reply.tokens_used,
                                         "cost_units": reply.cost_used}))
    return Done(_summary(ctx, reply), ok=reply.state == "ended", facts=facts)


def subagent_changes(op: SubagentChangesOp, ctx: OpContext) -> Outcome:
    reply = _request(ctx, protocol.SubagentChanges(msg_id=new_msg_id("sc"), parent=ctx.agent,
                                                   subagent_id=op.subagent_id), 10.0,
                     retries=HOST_RESTART_RETRIES)
    if not isinstance(reply, protocol.SubagentReply):
        return reply
    return Done(_summary(ctx, reply, with_patch=True))


def apply_subagent(op: ApplySubagentOp, ctx: OpContext) -> Outcome:
    reply = _request(ctx, protocol.ApplySubagent(msg_id=new_msg_id("ap"), parent=ctx.agent,
                                                 subagent_id=op.subagent_id), 30.0,
                     retries=HOST_RESTART_RETRIES)
    if not isinstance(reply, protocol.SubagentReply):
        return reply
    return Done(_summary(ctx, reply), ok=reply.refusal is None and reply.state == "applied")


OPS = (OpSpec(SpawnSubagentOp, spawn_subagent), OpSpec(SubagentChangesOp, subagent_changes),
       OpSpec(ApplySubagentOp, apply_subagent))
