"""`[trust]` of a run manifest: who may do what (re-exported by `p2p_diloco.config`)."""

from __future__ import annotations

from dataclasses import dataclass

from p2p_diloco.errors import ConfigError


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


LEARNERS_ANY = "any"


@dataclass(frozen=True)
class TrustConfig:
    """Who may do what in a run (`[trust]`, see docs/security.md).

    `authority`: the organizer's peer ID; when set the run is *public*: the manifest must carry the
    authority's detached signature (`MANIFEST.sig`, `p2p-diloco manifest sign`), only `synchronizers` may
    hold the lease, and the public-run defaults of `[robust]` apply. `learners`: "any" or a list of peer IDs
    that may send deltas. `evaluators`: peers besides the synchronizers whose global eval points count
    (dedicated evaluators, `join --evaluate`). An empty `[trust]` keeps a private run open to every peer
    (with a warning).
    """

    authority: str = ""
    synchronizers: tuple[str, ...] = ()
    learners: str | tuple[str, ...] = LEARNERS_ANY
    evaluators: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _require(isinstance(self.authority, str), "trust.authority must be a peer ID string (Qm...)")
        _require(
            not self.authority or _looks_like_peer_id(self.authority),
            f"trust.authority must be a peer ID (Qm..., from `p2p-diloco keygen`), got {self.authority!r}",
        )
        _require(
            isinstance(self.synchronizers, tuple)
            and all(isinstance(p, str) and _looks_like_peer_id(p) for p in self.synchronizers),
            f"trust.synchronizers must be a list of peer IDs (Qm...), got {self.synchronizers!r}",
        )
        if isinstance(self.evaluators, list):
            object.__setattr__(self, "evaluators", tuple(self.evaluators))
        _require(
            isinstance(self.evaluators, tuple)
            and all(isinstance(p, str) and _looks_like_peer_id(p) for p in self.evaluators),
            f"trust.evaluators must be a list of peer IDs (Qm...), got {self.evaluators!r}",
        )
        _require(
            not self.authority or bool(self.synchronizers),
            "a run with trust.authority must list trust.synchronizers (the only peers that may hold the "
            "lease); add at least one peer ID, e.g. the authority's own",
        )
        learners = self.learners
        if isinstance(learners, list):
            learners = tuple(learners)
            object.__setattr__(self, "learners", learners)
        _require(
            learners == LEARNERS_ANY
            or (
                isinstance(learners, tuple)
                and all(isinstance(p, str) and _looks_like_peer_id(p) for p in learners)
            ),
            f'trust.learners must be "any" or a list of peer IDs (Qm...), got {learners!r}',
        )

    @property
    def public(self) -> bool:
        """A run with an authority: signed manifest, listed synchronizers, strangers expected."""
        return bool(self.authority)

    def may_synchronize(self, peer: str) -> bool:
        return not self.synchronizers or peer in self.synchronizers

    def may_learn(self, peer: str) -> bool:
        return self.learners == LEARNERS_ANY or peer in self.learners or peer in self.synchronizers

    def may_evaluate(self, peer: str) -> bool:
        """Whose global eval points count: the synchronizers and the listed evaluators (anyone when neither
        is listed)."""
        return (
            not self.synchronizers and not self.evaluators
        ) or peer in self.synchronizers + self.evaluators


def _looks_like_peer_id(text: str) -> bool:
    """A base58 libp2p peer ID (RSA IDs start with Qm); the DHT and transport check the key behind it."""
    alphabet = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
    return 40 <= len(text) <= 64 and all(c in alphabet for c in text)
