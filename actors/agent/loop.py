"""The agent loop: one step at a time, every fact through the writer first.

    context -> model -> validate -> gate -> dispatch -> record

The state in memory is always the fold of the stream, so a killed process
rebuilds it and calls `step()` again. See docs/agents.md ("The loop",
"Recovery").
"""

from __future__ import annotations

import errno
import time
from contextlib import AbstractContextManager, nullcontext
from enum import Enum
from pathlib import Path
from typing import Any

import structlog

from actors.agent import catalog, faults
from actors.agent.backends import make_backend
from actors.agent.journal import Journal
from actors.agent.recordable import recordable_actions, recordable_text
from actors.kernel import (
    compaction,
    effects,
    gate,
    operator_input,
    pipeline_track,
    workspace,
)
from actors.kernel.fold import RECENT_MAX, SESSION_STARTED
from actors.kernel.ops import Done, OpBase, OpContext, Rejected, Write, is_local, model_for
from actors.kernel.reply import Backend
from actors.kernel.settings import AgentSpec, Task, load_task, workspace_for
from actors.kernel.state import AgentState, Call
from actors.kernel.vault import SealedInputMissingError, Vault
from actors.sessions import rebuild
from actors.sessions.ids import is_session_id
from actors.sessions.lifecycle import session_to_start
from actors.sessions.purged import purged_of
from actors.sessions.transcript import Transcript
from actors.trees import recorder
from actors.writer.client import WriterClient, encode_payload
from broker.control import CallWatch
from broker.errors import PathRefusedError
from broker.statedir import StateDir

PHASE_CODES = {"new": 0, "running": 1, "paused": 2, "finished": 3, "closed": 4}
LOCAL_BACKENDS = frozenset({"scripted", "replay"})  # no call leaves the process


class Step(Enum):
    PROGRESS = "progress"  # did something: step again at once
    WAIT = "wait"  # waits for the operator (approval, budget): sync, then step
    DONE = "done"  # the session is over


class AgentLoop:
    def __init__(
        self, name: str, state_dir: StateDir, spec: AgentSpec, writer: WriterClient,
        *, fault_spec: str | None = None, peer: Any = None, watch: CallWatch | None = None,
    ) -> None:
        self.name = name
        catalog.install()  # the ops this loop runs (done already in a zygote-forked agent)
        self.state_dir = state_dir
        self.spec = spec
        self.settings = spec.settings
        self.writer = writer
        # a pipeline runner's task is its run file, read by its backend
        self.task = Task() if spec.backend == "pipeline" else load_task(spec.task)
        self.workspace = workspace_for(state_dir, name, spec)
        self.workspace.mkdir(parents=True, exist_ok=True)
        self.memory_dir = state_dir.memory_dir / name
        self.agent_dir = state_dir.agent_dir(name)
        self.faults = faults.Faults(self.agent_dir, fault_spec)
        self.effects = effects.EffectJournal(self.agent_dir)
        self.vault = Vault(self.agent_dir)
        self.summaries = compaction.SummaryCache(self.agent_dir)
        self.transcript = Transcript(state_dir.root)
        self._restarted = False  # rebuilt an open session: the next step records a segment
        self._first_rebuild = True
        self._purged: set[str] = set()  # ids of purged sessions: never begun again
        self.log = structlog.get_logger("agent").bind(agent=name)
        self._backend: Backend | None = None
        self.rebuild_ms = 0.0
        self.peer = peer  # BrokerPeer | None: for ops served by other actors
        self.watch = watch
        self.trees = recorder.TreeRecorder(state_dir, name, self.workspace,
                                           watch=self.settings.watch_workspace)
        # the stream: the state, the facts folded and not yet durable, generations
        self.journal = Journal(name, state_dir, writer, settings=self.settings, trees=self.trees,
                               log=self.log, busy=self._busy, refold=self.rebuild)
        self.stream = self.journal.stream
        self._tree_recorded_at = -1  # facts_appended right after the last tree it recorded
        # `_parsed`: the turn parsed, and by index the state's action object and its parse
        self._parse_turn = -1
        self._parse_cache: dict[int, tuple[Any, OpBase | Rejected]] = {}

    def _busy(self, op: str, deadline_s: float) -> AbstractContextManager[None]:
        """Declare a blocking call (heartbeats go on while it runs)."""
        return self.watch.busy(op, deadline_s) if self.watch is not None else nullcontext()

    # --- state ---------------------------------------------------------------
    @property
    def state(self) -> AgentState:
        """The fold of the stream, pending facts included (the journal's)."""
        return self.journal.state

    def sync(self) -> None:
        """Fold whatever the stream holds after our last seq."""
        self.journal.sync()

    def flush(self) -> None:
        """Make the pending facts durable (journal.py)."""
        self.journal.flush()

    def rebuild(self) -> rebuild.Rebuilt:
        recorder.finish_pending(self.writer, self.state_dir, self.name)  # a rewind cut short
        done = rebuild.rebuild(self.writer, self.state_dir, self.name)
        self.journal.state = done.state
        self.rebuild_ms = done.elapsed_ms
        self.journal.since_generation = done.tail_events
        # the process's first rebuild (a later one only refolds): a new run segment
        self._restarted = self._first_rebuild and self.state.phase == "running"
        self._first_rebuild = False
        self._purged = {p.session_id for p in purged_of(self.state_dir.root, self.stream)}
        self.log.info("state_rebuilt", generation_seq=done.from_generation,
                      tail_events=done.tail_events, elapsed_ms=done.elapsed_ms,
                      phase=self.state.phase, turn=self.state.turn)
        return done

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            def read_turns(stream: str) -> list[Any]:
                return [r.payload() for r in self.writer.read_stream(stream, 1)
                        if r.event == "turn"]
            self._backend = make_backend(self.spec, self.task, read_turns,
                                         agent_dir=self.agent_dir)
        return self._backend

    def values(self) -> dict[str, int | float]:
        """Heartbeat values: what `supervisor status` and `run` show."""
        s = self.state
        names = catalog.op_names()
        return {
            "turn": s.turn, "phase": PHASE_CODES[s.phase], "tool_calls": s.counts.tool_calls,
            "last_op": names.index(s.last_op) + 1 if s.last_op in names else 0,
            "waiting": len(s.pending_approvals()), "events": s.counts.events,
            "rebuild_ms": self.rebuild_ms, "rejects": s.counts.rejects,
            "aborts": s.counts.aborted, "tokens_used": s.budget.tokens_used,
            "cost_used": round(s.budget.cost_used, 3),
        }

    # --- bounds ----------------------------------------------------------------
    def budget_left(self) -> bool:
        b, limit = self.state.budget, self.settings.budget
        if limit.tokens is not None and b.tokens_used >= limit.tokens + b.extra_tokens:
            return False
        return not (limit.cost_units is not None
                    and b.cost_used >= limit.cost_units + b.extra_cost)

    # --- the step --------------------------------------------------------------
    def step(self) -> Step:
        result = self._step()
        if result is not Step.PROGRESS:
            self.flush()  # the operator and the supervisor see what it waits on
        return result

    def _step(self) -> Step:
        s = self.state
        wanted = self.spec.session if self.spec.session not in self._purged else None
        begin = session_to_start(s, wanted)
        if begin is not None:
            self._session_started(begin)
            return Step.PROGRESS
        restarted, self._restarted = self._restarted, False
        if s.open_turn is None or s.phase != "running":
            self.vault.clear()  # it keeps texts only for an open turn of a running session
            self._parse_cache.clear()  # (parses hold the texts opened)
        if s.phase in ("finished", "closed"):
            return Step.DONE
        if s.phase == "paused":
            if not self.budget_left():
                return Step.WAIT
            self._session_start(resumed=True)
            return Step.PROGRESS
        if s.phase == "new":
            self._session_start(resumed=False)
            return Step.PROGRESS
        if restarted and s.phase == "running":
            if not any(c.op == "apply_subagent" for c in s.started_unsettled()):
                # (while an apply may be running, the subagents host writes here too)
                swept = workspace.remove_leftovers(self.workspace, self.state_dir)
                if swept:
                    self.log.info("write_leftovers_removed", count=swept)  # a kill cut a write
            self._session_start(resumed=True, reason="restart")  # a new run segment
            return Step.PROGRESS
        if s.open_turn is not None:
            dangling = [c for c in s.started_unsettled()
                        if not _replay_safe(c, s, self.state_dir, self.name)]
            if dangling:
                self._abort(dangling)
                return Step.PROGRESS
            return self._advance_turn(s.open_turn)
        if self._record_tree():
            return Step.PROGRESS
        if s.turn >= self.settings.max_turns:
            self._exit("max_turns")
            return Step.PROGRESS
        if not self.budget_left():
            self._exit("budget")
            return Step.PROGRESS
        deadline_s = float(getattr(self.backend, "deadline_s", 0.0))
        if compaction.advance(s, self.settings.compaction, summaries=self.summaries,
                              backend=self.backend, append=self.journal.append, flush=self.flush,
                              hit=self.faults.hit, recent_max=RECENT_MAX,
                              busy=lambda: self._busy("model", deadline_s)):
            return Step.PROGRESS  # the context was compacted (docs/operator-input.md)
        turn = s.turn + 1
        # an operator input's consumption is durable before the request it feeds
        operator_input.consume(s, turn, self.journal.append, self.flush, self.faults.hit)
        if self.spec.backend not in LOCAL_BACKENDS:
            self.flush()  # nothing pending waits on a remote model's answer
        s = self.state  # (a flush that met the operator's records refolds the state)
        inputs = operator_input.texts(self.agent_dir, s, turn)
        with self._busy("model", float(getattr(self.backend, "deadline_s", 0.0))):
            reply = self.backend.next_reply(s, inputs)
        self.faults.hit("after_model_reply", f"t{turn}")
        actions = self.vault.seal(recordable_actions(reply.actions))
        self.transcript.record(s, turn, self.backend, reply, actions)
        payload: dict[str, Any] = {"turn": turn, "actions": actions,
                                   "usage": reply.usage.as_dict(), "backend": self.backend.name,
                                   "context_tokens": compaction.context_tokens(s)}
        if reply.text:
            payload["text"] = recordable_text(reply.text)
        if reply.meta is not None:
            payload["pipeline"] = reply.meta
        self.journal.append("turn", payload, key=f"t{turn}:turn", ledger="budget")
        return Step.PROGRESS

    def _session_started(self, session: str) -> None:
        """Begin a new session of this agent's stream (actors/sessions/lifecycle.py).

        Not folded ahead of the WAL as `journal.append` does: the state keeps
        this fact's seq (`session_seq`), and seqs are global, so the one it
        would fold it at is not the one it gets. It is made durable first,
        then folded from the stream at its real seq."""
        self.flush()
        body = encode_payload({
            "session": session, "agent": self.name, "number": self.state.session_no + 1,
            "previous": self.state.session, "parent_agent": self.spec.parent_agent,
        })
        self.journal.facts_appended += 1
        with self._busy("append", self.journal.append_deadline_s()):
            self.writer.append_many(self.stream, [(SESSION_STARTED, body,
                                                   f"session:{session}", None)])
        self.sync()
        self.log.info("session_started", session=session, number=self.state.session_no)

    def _session_start(self, *, resumed: bool, reason: str | None = None) -> None:
        segment = self.state.segment + 1
        self.transcript.begin_segment(self.state.session, segment)
        self.journal.append("session_start", {
            "session": self.state.session,
            "reason": reason or ("budget" if resumed else "start"),
            "segment": segment, "resumed": resumed, "backend": self.spec.backend,
            "task": Path(self.spec.task).name, "workspace": str(self.workspace),
            "max_turns": self.settings.max_turns,
            **self._spec_session(),
        }, key=f"s{segment}:start")

    def _spec_session(self) -> dict[str, str]:
        """The spec's later session id this segment goes on under (a spawn or
        start over an open session), so that id never begins one once this
        session is over (actors/sessions/lifecycle.py)."""
        wanted, current = self.spec.session, self.state.session
        if is_session_id(wanted) and current is not None and str(wanted) > current:
            return {"spec_session": str(wanted)}
        return {}

    def _record_tree(self) -> bool:
        """At a turn boundary: append `workspace_tree` if the workspace changed
        (under the trees' collection lease until the flush that makes the fact
        durable; the objects' sync runs meanwhile: actors/trees/recorder.py). The step
        right after a recorded tree, with no fact since, does not walk the
        workspace again: nothing of the agent's ran in between."""
        if self._tree_recorded_at == self.journal.facts_appended:
            return False
        self.trees.hold()  # released by the flush that makes the fact durable
        fact = self._tree_fact()
        if fact is None:
            if not self.journal.pending:
                self.trees.released()
            return False
        self.journal.append(*fact)
        self._tree_recorded_at = self.journal.facts_appended
        return True

    def _tree_fact(self) -> tuple[str, dict[str, Any], str] | None:
        """The workspace's capture; a full disk under the trees store (ENOSPC,
        EDQUOT) is waited out as an append waits for a full writer: a declared
        call (`busy: tree_capture` in status, heartbeats going on), for up to
        the writer client's `storage_wait_s`, then it raises (docs/storage.md).
        A capture that failed is not trusted by the next one (actors/trees/
        capture.py: its objects are checked again)."""
        try:
            return self.trees.fact(self.state)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            self.log.warning("tree_capture_waiting", error=exc.strerror)
        wait_s = float(getattr(self.writer, "storage_wait_s", 0.0))
        deadline = time.monotonic() + wait_s
        backoff_s = 0.05
        with self._busy("tree_capture", wait_s):
            while True:
                waiting = getattr(self.writer, "storage_waiting", None)
                if waiting is not None:
                    waiting()
                time.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 1.0)
                try:
                    return self.trees.fact(self.state)
                except OSError as exc:
                    if exc.errno not in (errno.ENOSPC, errno.EDQUOT) \
                            or time.monotonic() >= deadline:
                        raise

    def _exit(self, reason: str, summary: str = "") -> None:
        self._record_tree()
        self.journal.append("session_exit", {
            "reason": reason, "resumable": reason == "budget", "turn": self.state.turn,
            "summary": summary[:500]}, key=f"s{self.state.segment}:exit")
        self.log.info("session_exited", reason=reason, turn=self.state.turn)

    def _advance_turn(self, turn: int) -> Step:
        s = self.state
        for index, action in enumerate(s.actions):
            cid = f"{turn}.{index}"
            call = s.calls.get(cid)
            if call is not None and call.settled:
                continue
            parsed = self._parsed(turn, index, action)
            if call is None:
                if pipeline_track.halted_before(s.pipeline, index):  # a pipeline step failed
                    self.journal.append("turn_aborted",
                                        {"turn": turn, "reason": "halted", "calls": []},
                                        key=f"t{turn}:aborted")
                    return Step.PROGRESS
                self.faults.hit("before_tool_call", cid)
                self.journal.append("tool_call", {
                    "call_id": cid, "turn": turn, "index": index,
                    "op": parsed.op if isinstance(parsed, OpBase) else None,
                }, key=f"c{cid}")
                return Step.PROGRESS
            if isinstance(parsed, Rejected):
                self.journal.append("schema_reject", {"call_id": cid, "op": parsed.op,
                                               "errors": parsed.errors}, key=f"c{cid}:reject")
                self.log.info("action_rejected", call_id=cid, op=parsed.op,
                              reason="; ".join(parsed.errors)[:500])
                return Step.PROGRESS
            return self._gate_and_dispatch(call, parsed)
        return Step.PROGRESS  # every call settled: the fold has closed the turn

    def _parsed(self, turn: int, index: int, action: Any) -> OpBase | Rejected:
        """Action `index` of `turn` parsed (its sealed texts opened): once a
        turn, not once a loop step (a turn's action was parsed again for its
        `tool_call`, its `permission` and its dispatch). Ops are frozen; the
        parse is kept for the very action object the state holds, so a state
        folded again (a rebuild) parses again."""
        if turn != self._parse_turn:  # a new turn: the last one's parses (and texts) go
            self._parse_cache.clear()
            self._parse_turn = turn
        kept = self._parse_cache.get(index)
        if kept is not None and kept[0] is action:
            return kept[1]
        try:
            parsed: OpBase | Rejected = catalog.parse_action(self.vault.open(action))
        except SealedInputMissingError as exc:
            parsed = Rejected(str(action.get("op")), [str(exc)])
        self._parse_cache[index] = (action, parsed)
        return parsed

    def _gate_and_dispatch(self, call: Call, op: OpBase) -> Step:
        cid = call.call_id
        if call.verdict is None:
            verdict = gate.decide(op, self.settings, self.state.grant_set(), self.workspace,
                                  self.state_dir)
            payload: dict[str, Any] = {"call_id": cid, "op": op.op, "decision": verdict.verdict,
                                       "rule": verdict.rule}
            if verdict.reason:
                payload["reason"] = verdict.reason
            if verdict.verdict == "ask":
                payload["request"] = f"req-{cid}"
            self.journal.append("permission", payload, key=f"c{cid}:perm")
            if verdict.verdict in ("deny", "excluded", "refused"):
                self.log.info("action_refused", call_id=cid, op=op.op, decision=verdict.verdict,
                              rule=verdict.rule, reason=verdict.reason or verdict.verdict)
            if verdict.verdict == "ask":
                self._request(call, op, verdict.pattern)
                self.flush()  # the operator sees the request
            return Step.PROGRESS
        if call.verdict in ("deny", "excluded", "refused"):
            status = {"deny": "denied"}.get(call.verdict, call.verdict)
            self._result(call, op, status, {"error": f"{status} by the gate ({call.rule})"})
            return Step.PROGRESS
        answer: dict[str, Any] | None = None
        if call.verdict == "ask":
            request = call.request or f"req-{cid}"
            approval = self.state.approvals.get(request)
            if approval is None:
                self._request(call, op, gate.pattern_of(op, self.workspace))
                return Step.PROGRESS
            if approval.status == "pending":
                return Step.WAIT
            answer = ({"decision": "answered", "request": request}
                      if approval.status == "answered" else
                      {"decision": "approve" if approval.status == "approved" else "deny",
                       "note": approval.note})
            if approval.status == "denied" and not op.needs_operator:
                self._result(call, op, "denied", {"error": "denied by the operator"})
                return Step.PROGRESS
        self._dispatch(call, op, answer)
        return Step.PROGRESS

    def _request(self, call: Call, op: OpBase, pattern: str) -> None:
        request = call.request or f"req-{call.call_id}"
        question = getattr(op, "question", None)
        self.journal.append("approval_requested", {
            "request": request, "call_id": call.call_id, "op": op.op, "pattern": pattern,
            "kind": "clarification" if op.needs_operator else "permission",
            "question": question, "agent": self.name,
        }, key=f"c{call.call_id}:req", ledger="approvals")
        self.log.info("approval_requested", request=request, op=op.op, pattern=pattern)

    def _context(self, answer: dict[str, Any] | None, call_id: str | None = None,
                 call: Call | None = None) -> OpContext:
        visible = None
        if call is not None and call.op is not None:
            op_name, rule, settings = call.op, call.rule, self.settings

            def visible(rel: str) -> bool:
                return gate.visible(op_name, rel, settings, rule)
        return OpContext(agent=self.name, workspace=self.workspace, memory_dir=self.memory_dir,
                         state_dir=self.state_dir,
                         max_result_chars=self.settings.max_result_chars, answer=answer,
                         peer=self.peer, path_visible=visible,
                         call_id=self._op_call_id(
                             self.state.branch + call_id if call_id else call_id),
                         max_command_timeout_s=self.settings.max_command_timeout_s,
                         writer=self.writer, nested=self._run_nested)

    def _run_nested(self, name: str, spec: AgentSpec, writer: Any, wait_s: float
                    ) -> AgentState | None:
        """A nested runner in this process (`pipeline_run`: the op reaches it
        through its context, actors/kernel/ops.py `NestedRun`): stepped until
        its session ends (its state), or None once it has waited for the
        operator past `wait_s`."""
        loop = AgentLoop(name, self.state_dir, spec, writer, peer=self.peer)
        loop.rebuild()
        deadline = time.monotonic() + wait_s
        while True:
            step = loop.step()
            if step is Step.DONE:
                return loop.state
            if step is Step.WAIT:
                if time.monotonic() > deadline:
                    return None
                time.sleep(spec.settings.approval_poll_ms / 1000)  # an operator's answer
                loop.sync()

    def _op_call_id(self, call_id: str | None) -> str | None:
        """The call id ops key their requests by (procs' msg ids, subagents): the
        stream's first session keeps `<turn>.<index>` (tasks name proc ids by it);
        a later one is `n<number>.<turn>.<index>`, so no two sessions share one."""
        if call_id is None or self.state.session_no <= 1:
            return call_id
        return f"n{self.state.session_no}.{call_id}"

    def _dispatch(self, call: Call, op: OpBase, answer: dict[str, Any] | None) -> None:
        cid = call.call_id
        ctx = self._context(answer, cid, call)
        local = is_local(op.op)
        if not local:
            self.flush()  # its handler acts through another actor: the call is durable first
            # served by another actor (a command, an MCP tool, a change set): it may
            # change the workspace in ways no event reports; the next capture walks
            self.trees.unsure()
        try:
            with self._busy(op.op, op.deadline_s(ctx)):
                outcome = catalog.handler_for(op.op)(op, ctx)
        except PathRefusedError as exc:
            outcome = Done({"error": exc.reason}, ok=False)
        except OSError as exc:
            outcome = _os_failure(exc)
        self.faults.hit("before_tool_start", cid)
        effect = None
        if isinstance(outcome, Write):
            effect, outcome = self._plan_write(call, outcome)
        self.journal.append("tool_start", {"call_id": cid, "op": op.op, "effect": effect},
                     key=f"c{cid}:start")
        if isinstance(outcome, Write):
            self.flush()  # the intent is durable before the effect
        self.faults.hit("after_tool_start", cid)
        if isinstance(outcome, Write):
            try:
                workspace.apply_write(outcome.target, outcome.content)
                outcome = Done(outcome.result)
            except PathRefusedError as exc:  # the walk refused it at write time
                outcome = Done({"error": exc.reason}, ok=False)
            except OSError as exc:
                outcome = _os_failure(exc)
        self.faults.hit("after_effect", cid)
        may_wait = self._result_may_wait(call)  # (before the result settles the step)
        self._result(call, op, outcome.status or ("ok" if outcome.ok else "error"),
                     outcome.result)
        if not local or (effect is not None and not may_wait):
            self.flush()  # the result of an effect is durable before anything else
        self.faults.hit("after_tool_result", cid)
        for j, (event, payload) in enumerate(outcome.facts):
            self.journal.append(event, payload, key=f"c{cid}:fact{j}")
        if outcome.ok and op.ends_session:
            self._exit("finished", str(getattr(op, "summary", "")))

    def _result_may_wait(self, call: Call) -> bool:
        """Whether the `tool_result` of a local effect may join the next group
        of facts (made durable with the next intent, or before a remote model
        call, a non-local op, a wait or an end) instead of on its own.

        An agent's: yes. Nothing outside the process has seen the result: the
        actions of a turn were all fixed by its reply (none reads another's
        result), a remote model is called only after a flush, and an in-process
        model (scripted, replay) answers from its cursor. Lost in a crash, the
        call is found started without a result and the abort rule settles it
        from the file digests, as it did for a crash between the effect and
        the result's own flush. A pipeline step's: only when no later step of
        its batch reads it (actors/kernel/pipeline_track.py: result_may_wait)."""
        if self.state.pipeline is None:
            return True
        return pipeline_track.result_may_wait(self.state.pipeline, call.index)

    def _plan_write(self, call: Call, write: Write) -> tuple[dict[str, Any] | None, Write | Done]:
        """The effect to record; `Done` when the effect journal shows this very write
        is already on disk (its WAL records were lost), so it is not applied twice,
        or when its note cannot be written (a full disk: `storage_full`, no effect)."""
        action_sha = effects.action_digest(self.state.actions[call.index])
        now = workspace.digest(write.target)
        session = self.state.session
        prior = self.effects.get(call.call_id, session)
        if (prior is not None and prior.action_sha == action_sha and prior.label == write.label
                and prior.before_sha != prior.after_sha and now == prior.after_sha):
            self.log.warning("effect_already_applied", call_id=call.call_id)
            return ({"path": write.label, "before_sha": prior.before_sha,
                     "after_sha": prior.after_sha}, Done(prior.result))
        after = workspace.content_digest(write.content)
        try:
            self.effects.record(effects.Entry(call.call_id, action_sha, write.label, now, after,
                                              write.result), session)
        except OSError as exc:  # no note, no effect: the write is not made
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            return None, _os_failure(exc)
        try:
            self.effects.prune(self.state.turn, session)
        except OSError as exc:  # a rewrite to drop old lines: again later
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
        return {"path": write.label, "before_sha": now, "after_sha": after}, write

    def _result(self, call: Call, op: OpBase, status: str, result: dict[str, Any]) -> None:
        self.journal.append("tool_result", {"call_id": call.call_id, "op": op.op, "status": status,
                                     "result": result}, key=f"c{call.call_id}:result")

    def _effect_target(self, label: str) -> workspace.Place | None:
        guard = workspace.guard_for(self.state_dir)
        if label.startswith("memory:"):
            return workspace.Place(self.memory_dir, f"{label.removeprefix('memory:')}.md", guard)
        try:
            return workspace.place(self.workspace, label, guard)
        except PathRefusedError:
            return None

    def _abort(self, dangling: list[Call]) -> None:
        """Close a turn whose started calls have no result (a crash): say what is known."""
        calls = []
        for call in dangling:
            applied: bool | None = None
            effect = call.effect
            if isinstance(effect, dict):
                target = self._effect_target(str(effect.get("path")))
                now = workspace.digest(target) if target is not None else "unknown"
                if now == effect.get("after_sha"):
                    applied = True
                elif now == effect.get("before_sha"):
                    applied = False
            calls.append({"call_id": call.call_id, "op": call.op, "effect_applied": applied})
        turn = self.state.open_turn
        self.journal.append("turn_aborted", {"turn": turn, "reason": "recovery", "calls": calls},
                     key=f"t{turn}:aborted")
        self.log.warning("turn_aborted", turn=turn, calls=len(calls),
                         ops=[f"{c['call_id']} {c['op']}" for c in calls])


def _os_failure(exc: OSError) -> Done:
    """An op's failed file operation as its result: a full disk or quota is the
    typed `storage_full` (the effect not made: retry once space is freed;
    docs/storage.md), any other error its text."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return Done({"error": "storage_full", "message": "no space left for the state "
                     "directory: the effect was not made; retry once space is freed"},
                    ok=False)
    return Done({"error": exc.strerror or type(exc).__name__}, ok=False)


def _replay_safe(call: Call, s: AgentState, state_dir: StateDir, agent: str) -> bool:
    model = model_for(call.op) if call.op else None
    if model is None:
        return False
    action = s.actions[call.index] if 0 <= call.index < len(s.actions) else None
    return model.replay_safe or model.replay_safe_for(action, state_dir, agent)
