"""Session data as a user meets it (docs/sessions.md), through `supervisor` only:

- a session whose agent saved state generations (a small `snapshot_every`)
  is purged like any other, and the agent's remaining files stay sound;
- fork and rewind by the agent's name after a purge reach nothing of the
  purged session;
- spawning an agent whose newest session is open resumes that session; it
  never runs a second one behind it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.acceptance.conftest import Corral

pytestmark = [pytest.mark.process]

MARKER = "purge-marker-7f3a9c"
DEFAULT_CONFIG = Path(__file__).parents[2] / "config" / "default.yaml"


def small_generations(corral: Corral) -> Path:
    """A user's copy of config/default.yaml that saves a generation every 4 events."""
    text = DEFAULT_CONFIG.read_text()
    assert "snapshot_every: 256" in text
    return corral.config(text.replace("snapshot_every: 256", "snapshot_every: 4"))


def task(corral: Corral, name: str, marker: str, steps: int = 6) -> Path:
    """A scripted task of `steps` edits whose text holds `marker`; its last
    edit takes the marker out of the workspace (which is the agent's, not the
    session's)."""
    lines = [f"name: {name}", f"prompt: Keep notes about {marker}.", "steps:",
             f'  - {{op: write_file, path: notes.md, content: "{marker} 0\\n"}}']
    lines += [f'  - {{op: edit_file, path: notes.md, old: "{marker} {i}", '
              f'new: "{marker} {i + 1}"}}' for i in range(steps)]
    lines.append(f'  - {{op: edit_file, path: notes.md, old: "{marker} {steps}", '
                 f'new: "{name} done"}}')
    lines.append(f"  - {{op: finish, summary: {name} done}}")
    return corral.write(f"{name}.yaml", "\n".join(lines) + "\n")


def run_to_end(corral: Corral, agent: str, task_file: Path) -> None:
    corral.run("spawn", agent, "--task", str(task_file))
    corral.wait_state(agent, {"exited"}, timeout_s=90)


def sessions(corral: Corral, agent: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = corral.json("sessions", "list", "--all", "--agent", agent)
    return rows


def purge(corral: Corral, sid: str) -> None:
    corral.run("sessions", "archive", sid)
    preview = corral.json("sessions", "purge", sid, "--preview")
    assert preview["refused"] is None, preview
    done = corral.json("sessions", "purge", sid, "--confirm", sid)
    assert done["ok"] and done["journal"] == "done", done


@pytest.mark.timeout(240)
def test_a_session_with_generations_is_purged(corral: Corral) -> None:
    corral.up(config=small_generations(corral))
    run_to_end(corral, "pr", task(corral, "first", "first-session"))
    run_to_end(corral, "pr", task(corral, "second", MARKER))
    first, second = (r["session_id"] for r in sessions(corral, "pr"))
    generations = corral.state_dir / "agents" / "pr" / "state"
    assert any(second in p.read_text() for p in generations.rglob("*.json"))  # saved state
    preview = corral.json("sessions", "purge", second, "--preview")
    assert any("generations" in e["path"] for e in preview["entries"]), preview

    purge(corral, second)

    assert [r["session_id"] for r in sessions(corral, "pr")] == [first]
    assert not any(second in p.read_text() for p in generations.rglob("*.json"))
    corral.run("sessions", "show", second, rc=1)
    # the agent goes on from what is left: a third session runs to its end
    run_to_end(corral, "pr", task(corral, "third", "third-session"))
    assert [r["status"] for r in sessions(corral, "pr")] == ["finished", "finished"]


@pytest.mark.timeout(240)
def test_spawn_over_an_open_session_resumes_it_and_runs_no_second(corral: Corral) -> None:
    corral.up()
    work = task(corral, "lk", "fork-source", steps=3)
    run_to_end(corral, "lk2", work)
    corral.run("fork", "lk2", "--name", "fa", "--at-turn", "1")
    (fork,) = sessions(corral, "fa")
    assert fork["status"] == "open", fork

    run_to_end(corral, "fa", work)  # the fork's session goes on, and only it

    rows = sessions(corral, "fa")
    assert [(r["session_id"], r["status"]) for r in rows] == [(fork["session_id"], "finished")]
    # a spawn once it is over is a new session, as for any finished agent
    run_to_end(corral, "fa", work)
    assert [r["status"] for r in sessions(corral, "fa")] == ["finished", "finished"]


@pytest.mark.timeout(300)
def test_after_a_purge_nothing_of_the_session_is_reached(corral: Corral) -> None:
    corral.up(config=small_generations(corral))
    run_to_end(corral, "pr", task(corral, "first", "first-session"))
    run_to_end(corral, "pr", task(corral, "second", MARKER))
    run_to_end(corral, "st", task(corral, "other", "other-session"))
    first, second = (r["session_id"] for r in sessions(corral, "pr"))
    purge(corral, second)

    # by the agent's name: a rewind of a purged newest session is refused, a
    # fork starts from the session before it
    refused = corral.run("rewind", "pr", "--to-turn", "1", rc=1)
    assert "purged" in refused.stderr, refused
    corral.run("fork", "pr", "--name", "z")
    shown = corral.json("sessions", "show", "z")
    assert shown["parent_session"] == first, shown
    # the one pass after the purge seals the WAL segment that holds its
    # records and compacts them out
    corral.run("gc")
    held = sorted(str(path.relative_to(corral.state_dir)) for path, data in corral.files_text()
                  if MARKER.encode() in data and corral.state_dir in path.parents)
    assert held == [], held

    # a purge killed once its files are staged: hidden at once, finished by `up`
    (other,) = (r["session_id"] for r in sessions(corral, "st"))
    corral.run("sessions", "archive", other)
    killed = corral.run("sessions", "purge", other, "--confirm", other, rc=None,
                        env={"CORRAL_PURGE_FAULT": "staged"})
    assert killed.returncode < 0, killed
    assert sessions(corral, "st") == []
    corral.run("stop")
    corral.up(config=small_generations(corral))
    again = corral.run("sessions", "purge", other, "--preview", rc=1)
    assert "already purged" in again.stderr, again
    assert not (corral.state_dir / "purge-staging" / other).exists()
