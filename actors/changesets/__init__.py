"""Change sets: what an isolated child changed in its copy of a workspace,
as an immutable, bounded record that a parent applies at most once.

    paths      the path rules (no absolute, `..`, `.git` in any case, control
               characters, `.corral/`) and file access through directory fds
               that never follows a link
    snapshot   copy a workspace for a child; index the base (hashes, one pack)
    gitpatch   render a git-format, binary-safe patch (what `git apply` takes)
    manifest   the on-disk format: changeset.json, changes.patch, blobs/
    build      compare the child's tree with the base; enforce the bounds
    apply      stale check, write-ahead intent, all-or-nothing, receipt, fact,
               recovery after a crash at any step

docs/changesets.md is the normative text.
"""
