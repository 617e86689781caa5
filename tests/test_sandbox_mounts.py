"""What the command sandbox hides and how (actors/procs/sandbox.py): the
split of hidden paths into directories (a tmpfs) and files (an empty file
bound over them), and the order of the mounts bwrap gets. The sandbox run
against hostile commands: tests/security/test_sandbox.py."""

from __future__ import annotations

from pathlib import Path

from actors.procs import sandbox


def test_files_and_directories_are_split_and_a_symlink_hides_its_target(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "inside.key").write_text("x")
    creds = tmp_path / "nats.creds"
    creds.write_text("x")
    (tmp_path / "link.key").symlink_to(creds)
    workspace = keys / "ws"  # a workspace inside a hidden directory is bound back there
    workspace.mkdir()
    (workspace / "deploy.key").write_text("x")
    dirs, files = sandbox.split_hidden(
        (str(keys), str(tmp_path / "link.key"), str(keys / "inside.key"),
         str(workspace / "deploy.key"), str(tmp_path / "missing")), str(workspace))
    assert dirs == (str(keys),)
    # inside.key is under the hidden directory already; deploy.key is under it too, but
    # in the workspace bound back inside it, so it needs its own mask; the link's target
    assert files == (str(creds), str(workspace / "deploy.key"))


def test_a_masked_file_gets_the_empty_file_bound_after_its_parents(tmp_path: Path) -> None:
    mask = sandbox.mask_file(str(tmp_path))
    assert Path(mask).stat().st_size == 0
    Path(mask).chmod(0o600)
    Path(mask).write_text("tampered")  # not empty any more: made again
    assert Path(sandbox.mask_file(str(tmp_path))).read_text() == ""
    confinement = sandbox.Confinement(workspace="/srv/ws", hidden=("/srv",),
                                      masked=("/srv/ws/deploy.key", "/etc/corral/bus.secret"),
                                      mask=mask)
    argv = sandbox.bwrap_argv(sandbox.SandboxPolicy(), confinement, "/srv/ws", {}, "t")
    binds = [(arg, argv[i + 1], argv[i + 2] if arg != "--tmpfs" else None)
             for i, arg in enumerate(argv) if arg in ("--tmpfs", "--bind", "--ro-bind")
             and argv[i + 1] != "/"]
    order = [b[1] if b[0] != "--ro-bind" else b[2] for b in binds]
    assert ("--ro-bind", mask, "/srv/ws/deploy.key") in binds
    assert ("--ro-bind", mask, "/etc/corral/bus.secret") in binds
    # the tmpfs over /srv, then the workspace bound back, then its masked file
    assert order.index("/srv") < order.index("/srv/ws") < order.index("/srv/ws/deploy.key")
