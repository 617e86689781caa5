"""Sessions: ids, the session index, the resolver, purge, and transcripts.

See docs/sessions.md.
"""
