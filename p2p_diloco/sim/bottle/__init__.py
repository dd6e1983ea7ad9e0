"""The swarm in a bottle: a deterministic simulator of whole nodes (issue #42).

One process, one thread, virtual time. Each simulated node is the project's own code: the real `Peer`
state machine under a `PeerDriver` subclass, the real `Learner` training the run's model, the real
`StateDir` (replica and peer state on disk, `events.jsonl`), `ReplicaSaver` and `PeerEventLog`, and the
stop path of `node.runtime.PeerNode.shutdown` step by step. Around the nodes: an in-memory network with
per-link latency, bandwidth, loss and partitions, and an in-memory DHT with hivemind's record rules.
Faults come from a seeded schedule; named invariants are checked after every event; a run is replayed
bit for bit from its seed.

Parts: `world` (clock, event loop, links, DHT, trace), `transport` (the `Transport` a node sees),
`driver` (the owner queue, timers and I/O queue of one node on virtual time), `node` (one node's
lifecycle: start, SIGKILL, SIGSTOP/SIGCONT, SIGTERM, restart), `faults` (the seeded schedule),
`invariants` (what must hold) and `run` (a scenario from a seed to a result). `docs/testing.md` says how
to replay a seed.
"""
