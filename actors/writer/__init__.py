"""The writer: the only process that appends to the WAL and the ledgers.

Also the WAL record format, group commit, start-up recovery, the stream index
and the client every other actor appends through. See docs/wal.md.
"""
