"""Workspace trees: content-addressed captures, restore, rewind and fork.

See docs/trees.md.
"""
