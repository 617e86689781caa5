"""Workspace trees: a content-addressed store of file contents (`store`), the
tree format (`tree`), the stat cache that makes capture follow what changed
(`statcache`), capture (`capture`), restore (`restore`), the active branch of
a stream (`branch`), rewind (`rewind`) and fork (`fork`). docs/trees.md."""
