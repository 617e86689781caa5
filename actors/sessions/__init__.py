"""Sessions: ids, the session index (`.corral/sessions.sqlite3`), the resolver,
purge, and transcripts (docs/sessions.md)."""
