"""The real peer: `PeerNode` (runtime), its thread guard, state directory, and the `join`/`status`
commands."""
