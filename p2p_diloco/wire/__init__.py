"""Bytes on the wire: `codec` (tensor frames: int8/fp32, error feedback), `sparse` (top-k bodies),
`blockwise` (shared tags, code table, byte reader) and `frames` (message records)."""
