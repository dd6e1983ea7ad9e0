"""The pure protocol core: no sockets, threads or wall clock. Time and randomness are passed in.

Every decision is returned as a `Decision(action, tag, detail)` (tags are `StrEnum`s, one per rule); the same
code drives the real peers, the in-process swarm and the paper-scale simulator.
"""
