"""Learner and synchronizer (sans-IO, shared by every driver), the interfaces hivemind hides behind,
and the in-process swarm that runs many peers in one process on a fake clock."""
