"""p2p_diloco: peer-to-peer Decoupled DiLoCo (arXiv 2604.21428) on a hivemind DHT."""

__version__ = "0.1.0"
