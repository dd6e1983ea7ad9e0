"""Who synchronizes each shard, as one peer sees it: the seats and their phases, the membership that reads
heartbeats and leases and runs the election, the new holder's handover check, the successor's watch and the
run-under-way gate. The rules themselves are pure, in `p2p_diloco.protocol` (`election`, `claim_guard`,
`lease_rules`, `candidates`, `shards`)."""
