"""`[trust]` of a run manifest: who may do what (re-exported by `p2p_diloco.config`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from p2p_diloco.schema import LAX, Rule, section

LEARNERS_ANY = "any"
# A base58 libp2p peer ID (RSA IDs start with Qm); the DHT and transport check the key behind it.
PEER_ID = "[1-9A-HJ-NP-Za-km-z]{40,64}"
PEER_TEXT = "a peer ID (Qm..., from `p2p-diloco keygen`)"
PEERS_TEXT = "a list of peer IDs (Qm..., from `p2p-diloco keygen`)"
PeerId = Annotated[str, Field(pattern=f"^{PEER_ID}$")]


@section("trust")
class TrustConfig:
    """Who may do what in a run (`[trust]`, see docs/security.md).

    `authority`: the organizer's peer ID; when set the run is *public*: the manifest must carry the
    authority's detached signature (`MANIFEST.sig`, `p2p-diloco manifest sign`), only `synchronizers` may
    hold the lease, and the public-run defaults of `[robust]` apply. `learners`: "any" or a list of peer IDs
    that may send deltas. `evaluators`: peers besides the synchronizers whose global eval points count
    (dedicated evaluators, `join --evaluate`). An empty `[trust]` keeps a private run open to every peer
    (with a warning).
    """

    authority: Annotated[str, Field(pattern=rf"^({PEER_ID})?$", description=PEER_TEXT)] = ""
    synchronizers: Annotated[tuple[PeerId, ...], LAX, Field(description=PEERS_TEXT)] = ()
    learners: Annotated[
        Literal["any"] | Annotated[tuple[PeerId, ...], LAX], Field(description=f'"any" or {PEERS_TEXT}')
    ] = LEARNERS_ANY
    evaluators: Annotated[tuple[PeerId, ...], LAX, Field(description=PEERS_TEXT)] = ()

    @model_validator(mode="after")
    def _authority_names_synchronizers(self) -> TrustConfig:
        if self.authority and not self.synchronizers:
            raise Rule(
                "synchronizers",
                [],
                "a run with trust.authority must list trust.synchronizers (the only peers that may hold "
                "the lease); add at least one peer ID, e.g. the authority's own",
            )
        return self

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
