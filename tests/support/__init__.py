"""Helpers shared by the test tiers (import as `tests.support...`)."""
