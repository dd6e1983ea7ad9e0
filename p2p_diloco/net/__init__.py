"""The network layer over hivemind: identities, addresses, DHT keys, the signed DHT store, the libp2p
transport and the bootstrap node.

Modules are imported on use (`from p2p_diloco.net.dht_store import create_dht`): importing hivemind
takes a couple of seconds, and `identity`/`addresses`/`keys` are useful without a running daemon.
"""
