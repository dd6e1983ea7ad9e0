"""Bytes on the wire: `codec` (int8/fp32 tensor frames, error feedback) and `frames` (message records)."""
