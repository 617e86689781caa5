"""Change sets: what an isolated child changed, applied by its parent once.

Path rules, snapshots, the git patch, the manifest, building and applying.
docs/changesets.md is the normative text.
"""
