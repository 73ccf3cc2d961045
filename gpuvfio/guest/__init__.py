"""Talking to guests: SSH with pinned keys, the host side of in-guest verification; payload/ runs
inside guests."""
