"""The writer: the only process that appends to the WAL and the ledgers
(`process`), and what it is made of: the WAL record format (`wal`), segment
files (`segments`), group commit (`groupcommit`), start-up recovery
(`recovery`, `checkpoint`), idempotency windows (`dedupe`), the ledgers
(`ledgers`), the per-stream index and its reader (`streamindex`,
`streamreader`), and the client every other actor appends through (`client`).
See docs/wal.md."""
