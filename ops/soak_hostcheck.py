"""The invariants of the fleet soak with real hosts, checked after it stopped.

See docs/soak.md ("The fleet soak with real hosts").
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import TYPE_CHECKING, Any

from actors.writer.wal import WalRecord, list_segments, parse_record
from broker.statedir import StateDir
from ops.soakcheck import read_journal

if TYPE_CHECKING:
    from ops.soak_hosts import Soak

SAVED = "generation_saved"  # its key names a seq: rewritten by an adoption


def read_stream(urls: list[str], host: str) -> list[tuple[int, int, int, list[bytes], bool]]:
    """(stream seq, first, last, lines, is_fence) of every message of `host`'s stream."""
    import nats

    from supervisor.fleet.replicate import parse_seq_range, stream_name

    async def go() -> list[tuple[int, int, int, list[bytes], bool]]:
        nc: Any = await nats.connect(urls, connect_timeout=2)
        try:
            js = nc.jetstream(timeout=10)
            info = await js.stream_info(stream_name(host))
            found: list[tuple[int, int, int, list[bytes], bool]] = []
            if int(info.state.messages):
                for seq in range(int(info.state.first_seq), int(info.state.last_seq) + 1):
                    msg = await js.get_msg(stream_name(host), seq)
                    headers = dict(msg.headers or {})
                    if "Corral-Fence" in headers:
                        found.append((seq, 0, 0, [], True))
                        continue
                    first, last = parse_seq_range(headers["Corral-Seq"])
                    found.append((seq, first, last,
                                  (msg.data or b"").splitlines(keepends=True), False))
            return found
        finally:
            await nc.close()

    return asyncio.run(go())


def wal_records(state_dir: StateDir) -> dict[int, WalRecord]:
    records: dict[int, WalRecord] = {}
    for _, path in list_segments(state_dir.wal_dir):
        with open(path, "rb") as f:
            for line in f:
                record = parse_record(line)
                if record is not None:
                    records[record.seq] = record
    return records


def adoptions(state_dir: StateDir) -> list[dict[str, Any]]:
    """The `fleet_agent_adopted` lines of a host's supervisor log."""
    path = state_dir.root / "logs" / "supervisor.log"
    if not path.exists():
        return []
    found = []
    for line in path.read_bytes().splitlines():
        if b"fleet_agent_adopted" not in line:
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == "fleet_agent_adopted":
            found.append(entry)
    return found


def _dups(records: list[WalRecord]) -> int:
    counts = Counter((r.origin, r.key) for r in records)
    return sum(1 for n in counts.values() if n > 1)


def check(soak: Soak, finished: set[str], owned: dict[str, list[Any]],
          stops: dict[str, int | None]) -> dict[str, Any]:
    from ops.soak_hosts import expected_workspace, workspace

    f: Counter[str] = Counter()
    examples: dict[str, list[str]] = {}

    def bad(kind: str, example: str, n: int = 1) -> None:
        f[kind] += n
        examples.setdefault(kind, [])
        if len(examples[kind]) < 5:
            examples[kind].append(example)

    streams: dict[str, dict[int, WalRecord]] = {}
    wals: dict[str, dict[int, WalRecord]] = {}
    for host in soak.hosts:
        try:
            messages = read_stream(soak.urls, host.name)
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            bad("stream_unreadable", f"{host.name}: {type(exc).__name__}")
            messages = []
        records: dict[int, WalRecord] = {}
        every: list[WalRecord] = []  # as stored, a seq stored twice twice
        expected, fenced = 1, False
        for _seq, first, last, lines, is_fence in messages:
            if is_fence:
                fenced = True
                continue
            if fenced:
                bad("appends_after_fence", f"{host.name}: batch {first}-{last}")
            if first != expected or len(lines) != last - first + 1:
                bad("stream_gaps", f"{host.name}: {first}-{last} after {expected - 1}")
            for offset, line in enumerate(lines):
                record = parse_record(line)
                if record is None or record.seq != first + offset:
                    bad("stream_gaps", f"{host.name}: unreadable record at {first + offset}")
                    continue
                records[record.seq] = record
                every.append(record)
            expected = last + 1
        if host.dead and not fenced:
            bad("dead_not_fenced", host.name)
        local = wal_records(host.state_dir)
        streams[host.name], wals[host.name] = records, local
        f["stream_records"] += len(records)
        if n := _dups(every):
            bad("duplicates", f"{host.name}: {n} in the stream", n)
        if n := _dups(list(local.values())):
            bad("duplicates", f"{host.name}: {n} in the local WAL", n)
        seqs = sorted(local)
        if seqs and seqs != list(range(1, seqs[-1] + 1)):
            bad("wal_gaps", host.name)
        for seq, record in records.items():
            if seq not in local or local[seq].line != record.line:
                bad("stream_mismatches", f"{host.name}: seq {seq}")
        beyond = [s for s in local if s > max(records, default=0)]
        if beyond and not host.dead:
            bad("unreplicated_live", f"{host.name}: {len(beyond)} records", len(beyond))
        f["unreplicated_dead"] += len(beyond) if host.dead else 0
        journals = sorted(host.journal.glob("*.acks")) if host.journal.is_dir() else []
        for path in journals:
            origin = path.name.removesuffix(".acks").replace("%", "/")
            for key, seq, _at in read_journal(path):
                f["acked"] += 1
                stored = records.get(seq)
                if stored is None or stored.key != key or stored.origin != origin:
                    bad("lost", f"{host.name}: {origin}/{key}@{seq}")

    by_name = {h.name: h for h in soak.hosts}
    # read once per host: its stream's and its WAL's records by stream, its acked seqs
    stream_by: dict[str, dict[str, list[WalRecord]]] = {}
    wal_by: dict[str, dict[str, list[WalRecord]]] = {}
    for name in by_name:
        for source, into in ((streams[name], stream_by), (wals[name], wal_by)):
            grouped: dict[str, list[WalRecord]] = {}
            for _, record in sorted(source.items()):
                grouped.setdefault(record.stream, []).append(record)
            into[name] = grouped
    acked_seqs = {h.name: [seq for path in (sorted(h.journal.glob("*.acks"))
                                            if h.journal.is_dir() else [])
                           for _k, seq, _a in read_journal(path)] for h in soak.hosts}
    for adopter in soak.hosts:
        adopter_keys: dict[str, set[tuple[str, str]]] = {}
        for record in wals[adopter.name].values():
            adopter_keys.setdefault(record.stream, set()).add((record.origin, record.key))
        for entry in adoptions(adopter.state_dir):
            dead, agent = str(entry.get("host")), str(entry.get("agent"))
            f["adoptions_logged"] += 1
            if dead not in by_name:
                bad("adoption_unknown_host", dead)
                continue
            mine = stream_by[dead].get(f"agent/{agent}", [])
            count = int(entry.get("records", 0))
            here = adopter_keys.get(f"agent/{agent}", set())
            for record in mine[:count]:
                if record.event != SAVED and (record.origin, record.key) not in here:
                    bad("adoption_missing", f"{dead}->{adopter.name}: {agent} {record.key}")
            f["adopted_records"] += count
            f["dropped_after_cut"] += len(mine) - count
            cut_seqs = {r.seq for r in mine[count:]}
            f["acked_after_cut"] += sum(1 for seq in acked_seqs[dead] if seq in cut_seqs)

    everyone = sorted({a for h in soak.hosts for a in h.agents})
    agents_ok = 0
    for agent in everyone:
        hosts = owned.get(agent, [])
        if len(hosts) > 1:
            bad("agents_on_two_hosts", f"{agent}: {[h.name for h in hosts]}")
            continue
        if not hosts:
            bad("agents_unowned", agent)
            continue
        owner = hosts[0]
        mine = [r for r in wal_by[owner.name].get(f"agent/{agent}", []) if r.event != SAVED]
        exits = [r for r in mine if r.event == "session_exit"]
        payload = exits[-1].payload() if exits else None
        reason = payload.get("reason") if isinstance(payload, dict) else None
        if agent not in finished or len(exits) != 1 or mine[-1] is not exits[-1] \
                or reason != "finished":
            bad("agents_not_finished", f"{agent} on {owner.name}: exits {len(exits)} "
                f"{reason} running-exit-0 {agent in finished}")
        else:
            agents_ok += 1
        calls = [p.get("call_id") for r in mine if r.event == "tool_result"
                 and isinstance(p := r.payload(), dict)]
        if len(calls) != len(set(calls)):
            bad("double_runs", f"{agent} on {owner.name}")
        have = workspace(owner.state_dir, agent)
        want = expected_workspace(agent, soak.repeat)
        if have != want:
            diff = sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k))
            bad("workspace_mismatches", f"{agent} on {owner.name}: {diff[:4]}")
    for restart in soak.fenced_restarts:
        if restart["exit"] != 69 or restart["stream_seq_after"] != restart["stream_seq_before"] \
                or restart["workspaces_changed"]:
            bad("fenced_restart_ran", json.dumps(restart))
    for name, code in stops.items():
        if code != 0:
            bad("supervisor_exit", f"{name}: {code}")
    return {**{k: f[k] for k in (
        "acked", "lost", "duplicates", "stream_gaps", "wal_gaps", "stream_mismatches",
        "unreplicated_live", "unreplicated_dead", "appends_after_fence", "dead_not_fenced",
        "adoptions_logged", "adoption_missing", "adopted_records", "dropped_after_cut",
        "acked_after_cut", "agents_on_two_hosts", "agents_unowned", "agents_not_finished",
        "double_runs", "workspace_mismatches", "fenced_restart_ran", "supervisor_exit",
        "stream_unreadable", "stream_records", "adoption_unknown_host")},
        "agents": len(everyone), "agents_finished": agents_ok, "examples": examples}


COUNTS = ("lost", "duplicates", "stream_gaps", "wal_gaps", "stream_mismatches",
          "unreplicated_live", "appends_after_fence", "dead_not_fenced", "adoption_missing",
          "agents_on_two_hosts", "agents_unowned", "agents_not_finished", "double_runs",
          "workspace_mismatches", "fenced_restart_ran", "supervisor_exit", "stream_unreadable",
          "adoption_unknown_host", "orphans", "live_hosts_expired")


def violations(figures: dict[str, Any]) -> list[str]:
    found = [f"{k}={figures[k]}" for k in COUNTS if figures.get(k)]
    found += [f"error: {e}" for e in figures.get("errors", [])]
    if "agents" not in figures:
        found.append("the checks did not run")
    if not figures.get("kills"):
        found.append("no host was killed")
    if not figures.get("adoptions"):
        found.append("no agent was adopted")
    if figures.get("agents") and figures.get("agents_finished") != figures.get("agents"):
        found.append(f"agents_finished={figures.get('agents_finished')} of "
                     f"{figures.get('agents')}")
    if not figures.get("acked"):
        found.append("nothing was acknowledged")
    return found



TAMPERED = ("lost", "workspace_mismatches", "appends_after_fence", "duplicates",
            "adoption_missing")


def tamper(soak: Soak) -> list[str]:
    """Plant one fault of each kind the checks look for, after the honest
    check (`--tamper`): the same checks run again must report every one, which
    shows that they can fail. Planted: an acknowledgement journaled for a
    record no stream holds (lost), a file added to a finished agent's
    workspace, a copy of a fenced host's first batch stored after its fence (an
    append after the fence, twice in the stream), and an adoption's log line
    copied to a host that never held the agent (its records are not there)."""
    import nats

    from supervisor.fleet.replicate import stream_name

    planted: list[str] = []
    journal = next((p for h in soak.hosts if h.journal.is_dir()
                    for p in sorted(h.journal.glob("*.acks"))), None)
    if journal is not None:
        with open(journal, "a", encoding="utf-8") as f:
            f.write("tampered-key\t999999999\t0.0\n")
        planted.append(f"lost: {journal.name}")
    owner = next((h for h in soak.hosts if not h.dead and h.agents), None)
    if owner is not None:
        target = owner.state_dir.agent_dir(owner.agents[0]) / "workspace" / "tampered.txt"
        if target.parent.is_dir():
            target.write_text("not written by the agent\n")
            planted.append(f"workspace: {owner.agents[0]}")
    dead = next((h for h in soak.hosts if h.dead), None)
    if dead is not None:
        async def go(host: str) -> None:
            nc: Any = await nats.connect(soak.urls, connect_timeout=2)
            try:
                js = nc.jetstream(timeout=10)
                info = await js.stream_info(stream_name(host))
                for seq in range(int(info.state.first_seq), int(info.state.last_seq) + 1):
                    first = await js.get_msg(stream_name(host), seq)
                    if "Corral-Seq" in (first.headers or {}):
                        break
                else:
                    raise RuntimeError(f"no batch in {host}'s stream")
                await js.publish(f"corral.wal.{host}.batch", first.data or b"",
                                 stream=stream_name(host),
                                 headers={"Corral-Seq": (first.headers or {})["Corral-Seq"]})
            finally:
                await nc.close()

        try:
            asyncio.run(go(dead.name))
            planted.append(f"after fence: {dead.name}")
        except Exception as exc:  # noqa: BLE001 - not planted: the test sees 3 of 4
            planted.append(f"not planted after the fence: {type(exc).__name__}: {exc}")
    entry = next((e for h in soak.hosts for e in adoptions(h.state_dir)
                  if int(e.get("records", 0)) > 0), None)
    if entry is not None:  # an adoption claimed by a host that never held the agent
        stream = f"agent/{entry.get('agent')}"
        stranger = next((h for h in soak.hosts if not any(
            r.stream == stream for r in wal_records(h.state_dir).values())), None)
        if stranger is not None:
            log = stranger.state_dir.root / "logs" / "supervisor.log"
            with open(log, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")
            planted.append(f"adoption: {entry.get('agent')} on {stranger.name}")
    return planted
