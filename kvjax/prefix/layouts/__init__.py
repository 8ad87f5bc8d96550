"""Prefix-cache block layouts, one per model family: how a cache's forms split into blocks and snapshots."""
