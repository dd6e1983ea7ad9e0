"""Run authority: the organizer's detached signature of a run manifest (`MANIFEST.sig`), and loading a
manifest the way every command that joins or watches a run must (`load_run_manifest`).

A manifest whose ``[trust] authority`` is set belongs to a *public* run. Its organizer signs it with
``p2p-diloco manifest sign MANIFEST --identity ORG.key``, which writes ``MANIFEST.sig`` beside it: a small
JSON object (`SignatureRecord`) holding the signer's peer ID and public key (a libp2p ``PublicKey``
protobuf, base64), the sha256 of the manifest file's exact bytes (so the ``bootstrap`` addresses, every
comment and every key are covered, not only what `manifest_hash` hashes), the sha256 of every file the
manifest names whose content is not in the manifest itself (`pinned_files`: the text files of
``data.paths``, the ``index.json`` of ``data.shards``, which in turn pins every shard's digest), and an
RSA-PSS/SHA-256 signature over all of that. The signature never needs the authority to be online.

`verify_manifest` refuses (`ManifestSignatureError`, a `ConfigError`, tagged with a `SignatureProblem`)
a missing or unreadable ``.sig``, a signer other than ``trust.authority``, an invalid signature, a
manifest changed after signing, and a present pinned file whose content differs; a pinned file that is
absent here is skipped (a peer that needs it fails on its own when opening it). Each message names the
file and the fix. The manifest is parsed from the very bytes that are verified (`read_manifest`).
`load_run_manifest` is what ``join``, ``status``, ``bootstrap --manifest`` and
``export`` call: it verifies a public manifest and, for one without an authority, prints one warning per
process and manifest to stderr that any peer can take over such a run.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import sys
import tomllib
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import TextIO

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding

from p2p_diloco.config import LEARNERS_ANY, DataSource, RunManifest
from p2p_diloco.errors import ConfigError
from p2p_diloco.files import write_atomic
from p2p_diloco.net.identity import load_identity, public_key_from_proto, public_key_proto
from p2p_diloco.packaged import missing_manifest_hint

SIG_SUFFIX = ".sig"
FORMAT = "p2p_diloco.manifest-signature.v1"
# Prefixed to the signed bytes so no other message signed with the same key (DHT records) can pass as one.
DOMAIN = b"p2p_diloco manifest signature v1\n"
HASH_CHUNK = 1 << 22
MAX_SIG_BYTES = 64 * 1024
_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.DIGEST_LENGTH)


class SignatureProblem(StrEnum):
    """Why a manifest signature was refused (`ManifestSignatureError.problem`)."""

    MISSING = "missing signature"
    MALFORMED = "malformed signature file"
    WRONG_SIGNER = "wrong signer"
    BAD_SIGNATURE = "invalid signature"
    MANIFEST_CHANGED = "manifest changed"
    FILES_CHANGED = "pinned files changed"
    NOT_AUTHORITY = "not the authority"


class ManifestSignatureError(ConfigError):
    """A public manifest's signature is missing or does not hold; the message names the file and the fix."""

    def __init__(self, problem: SignatureProblem, message: str):
        self.problem = problem
        super().__init__(message)


@dataclass(frozen=True)
class PinnedFile:
    """A file a manifest names whose content its signature covers: `what` (``data.paths[0]``), the path
    as written in the manifest and where it resolves on this machine."""

    what: str
    path: str
    resolved: Path


@dataclass(frozen=True)
class SignatureRecord:
    """The content of a ``.sig`` file; every field but `signature` is signed (`signed_bytes`)."""

    format: str
    run_id: str
    manifest: str  # the manifest's file name when signed (informational: a copy may be renamed)
    manifest_hash: str
    sha256: str  # of the manifest file's bytes
    files: tuple[tuple[str, str, str], ...]  # (what, path as written, sha256) of every pinned file
    signer: str  # peer ID of the signing key
    public_key: str  # base64 libp2p PublicKey protobuf
    signature: str = ""  # base64 RSA-PSS (SHA-256) over DOMAIN + signed_bytes()

    def signed_bytes(self) -> bytes:
        body = {k: v for k, v in asdict(self).items() if k != "signature"}
        return DOMAIN + json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    def to_json(self) -> str:
        data = asdict(self)
        data["files"] = [{"what": w, "path": p, "sha256": h} for w, p, h in self.files]
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> SignatureRecord:
        """Parse a ``.sig``; `ValueError` saying what is wrong."""
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} file")
        files = data.get("files", [])
        if not isinstance(files, list) or not all(isinstance(f, dict) for f in files):
            raise ValueError("'files' must be a list of {what, path, sha256}")
        data["files"] = tuple((str(f.get("what")), str(f.get("path")), str(f.get("sha256"))) for f in files)
        names = {
            "format",
            "run_id",
            "manifest",
            "manifest_hash",
            "sha256",
            "signer",
            "public_key",
            "signature",
        }
        if set(data) != names | {"files"} or not all(isinstance(data[n], str) for n in names):
            raise ValueError(f"expected exactly the string fields {sorted(names)} and 'files'")
        return cls(**data)


@dataclass(frozen=True)
class Verified:
    """A manifest whose signature holds: the signer (= the authority), the pinned files checked here and
    those absent here (not checked)."""

    signer: str
    checked: tuple[str, ...]
    absent: tuple[str, ...]


def signature_path(manifest_path: str | Path) -> Path:
    """``peers/x.toml`` -> ``peers/x.toml.sig``."""
    path = Path(manifest_path)
    return path.with_name(path.name + SIG_SUFFIX)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def pinned_files(manifest: RunManifest) -> list[PinnedFile]:
    """The files whose content the manifest names but does not hold (module docstring). A `[model] config`
    file is not among them: its content is part of `manifest_hash`; `[model] init` is pinned by
    `weights_digest`, as is `[model] pretrained` (`sign_manifest` insists on one)."""
    data = manifest.data
    if data.source == DataSource.FILES:
        return [PinnedFile(f"data.paths[{i}]", p, data.path(p)) for i, p in enumerate(data.paths)]
    if data.source == DataSource.SHARDS:
        from p2p_diloco.model.shards import INDEX_FILE  # here: it imports torch, which `status` need not

        index = f"{data.shards.rstrip('/')}/{INDEX_FILE}"
        return [PinnedFile("data.shards index", index, data.path(data.shards) / INDEX_FILE)]
    return []


def read_manifest(path: str | Path) -> tuple[bytes, RunManifest]:
    """A manifest file's bytes and the manifest parsed from exactly those bytes, so what is verified is
    what is used even if the file changes meanwhile (errors worded as `RunManifest.load`'s)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(missing_manifest_hint(path))
    try:
        blob = path.read_bytes()
        raw = tomllib.loads(blob.decode())
    except OSError as exc:
        raise ConfigError(f"cannot read manifest {path}: {exc.strerror or exc}") from exc
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"manifest {path} is not valid TOML: {exc}") from exc
    return blob, RunManifest.from_dict(raw, where=str(path), base_dir=str(path.resolve().parent))


def _sign_fix(manifest_path: Path) -> str:
    return f"`p2p-diloco manifest sign {manifest_path} --identity ORG.key`"


def sign_manifest(
    manifest_path: str | Path, identity: str | Path, *, out: str | Path | None = None
) -> tuple[Path, SignatureRecord]:
    """Sign `manifest_path` with the authority's key file `identity`; write ``MANIFEST.sig`` (or `out`)."""
    manifest_path = Path(manifest_path)
    blob, manifest = read_manifest(manifest_path)
    key = load_identity(identity)
    proto = public_key_proto(key)
    _, signer = public_key_from_proto(proto)
    authority = manifest.trust.authority
    if not authority:
        raise ManifestSignatureError(
            SignatureProblem.NOT_AUTHORITY,
            f"{manifest_path} has no [trust] authority, so nobody would check a signature: add\n"
            f'[trust]\nauthority = "{signer}"\nsynchronizers = ["{signer}"]\n'
            "(the peer IDs that may hold the synchronizer role) and sign again",
        )
    if signer != authority:
        raise ManifestSignatureError(
            SignatureProblem.NOT_AUTHORITY,
            f"{identity} is peer {signer}, but {manifest_path} names trust.authority {authority}: sign with "
            f'the authority\'s key, or set authority = "{signer}" in its [trust] section',
        )
    loads = manifest.model.init or manifest.model.pretrained
    if loads and not manifest.model.weights_digest:
        raise ConfigError(
            f"{manifest_path} loads weights from {loads!r} ([model]) without weights_digest: set "
            "weights_digest (`p2p-diloco model-digest` prints it) so the signed manifest pins the weights"
        )
    files = []
    for pinned in pinned_files(manifest):
        if not pinned.resolved.is_file():
            raise ConfigError(
                f"{manifest_path} names {pinned.what} = {pinned.path!r} ({pinned.resolved}), which does not "
                "exist here: the organizer signs with the run's files in place"
            )
        files.append((pinned.what, pinned.path, file_sha256(pinned.resolved)))
    record = SignatureRecord(
        format=FORMAT,
        run_id=manifest.run_id,
        manifest=manifest_path.name,
        manifest_hash=manifest.manifest_hash,
        sha256=hashlib.sha256(blob).hexdigest(),
        files=tuple(files),
        signer=signer,
        public_key=base64.b64encode(proto).decode(),
    )
    signature = key.sign(record.signed_bytes(), _PSS, hashes.SHA256())
    record = SignatureRecord(**{**asdict(record), "signature": base64.b64encode(signature).decode()})
    target = Path(out) if out is not None else signature_path(manifest_path)
    write_atomic(target, record.to_json().encode())
    return target, record


def _read_record(manifest_path: Path, sig: Path, authority: str) -> SignatureRecord:
    fetch = f"fetch {sig.name} again from the run's organizer (it is published beside {manifest_path.name})"
    if not sig.is_file():
        raise ManifestSignatureError(
            SignatureProblem.MISSING,
            f"{manifest_path} names trust.authority {authority}, but its signature {sig} is missing: fetch "
            f"{sig.name} from the run's organizer (it is published beside {manifest_path.name}) and put it "
            f"next to the manifest; the organizer writes it with {_sign_fix(manifest_path)}",
        )
    try:
        raw = sig.read_bytes()
        if len(raw) > MAX_SIG_BYTES:
            raise ValueError(f"{len(raw)} bytes, more than a signature file ever holds")
        return SignatureRecord.from_json(raw.decode())
    except (OSError, ValueError, TypeError) as exc:
        raise ManifestSignatureError(
            SignatureProblem.MALFORMED, f"{sig} is not a manifest signature ({exc}): {fetch}"
        ) from exc


def verify_manifest(manifest_path: str | Path) -> Verified:
    """Check ``MANIFEST.sig`` against the manifest's ``trust.authority`` (module docstring)."""
    blob, manifest = read_manifest(manifest_path)
    return _verify(Path(manifest_path), blob, manifest)


def _verify(manifest_path: Path, blob: bytes, manifest: RunManifest) -> Verified:
    authority = manifest.trust.authority
    if not authority:
        raise ConfigError(f"{manifest_path} has no [trust] authority: there is no signature to check")
    sig = signature_path(manifest_path)
    record = _read_record(manifest_path, sig, authority)
    refetch = f"fetch {manifest_path.name} and {sig.name} again from the run's organizer"
    try:
        public_key, signer = public_key_from_proto(base64.b64decode(record.public_key, validate=True))
    except ValueError as exc:
        raise ManifestSignatureError(
            SignatureProblem.MALFORMED, f"{sig} holds no usable public key ({exc}): {refetch}"
        ) from exc
    if signer != authority or record.signer != authority:
        raise ManifestSignatureError(
            SignatureProblem.WRONG_SIGNER,
            f"{sig} is signed by {signer}, but {manifest_path} names trust.authority {authority}: "
            f"this is not the organizer's signature; {refetch} (an organizer signs with the authority's key: "
            f"{_sign_fix(manifest_path)})",
        )
    try:
        public_key.verify(
            base64.b64decode(record.signature, validate=True), record.signed_bytes(), _PSS, hashes.SHA256()
        )
    except (InvalidSignature, ValueError) as exc:
        raise ManifestSignatureError(
            SignatureProblem.BAD_SIGNATURE,
            f"{sig} does not hold a valid signature (it was altered): {refetch}",
        ) from exc
    if hashlib.sha256(blob).hexdigest() != record.sha256:
        raise ManifestSignatureError(
            SignatureProblem.MANIFEST_CHANGED,
            f"{manifest_path} was changed after it was signed (its bytes differ from those {sig} signs): "
            f"{refetch}; an organizer who edited it signs again with {_sign_fix(manifest_path)}",
        )
    return _check_files(manifest_path, manifest, sig, record)


def _check_files(manifest_path: Path, manifest: RunManifest, sig: Path, record: SignatureRecord) -> Verified:
    signed = {(what, path): digest for what, path, digest in record.files}
    checked, absent = [], []
    for pinned in pinned_files(manifest):
        digest = signed.pop((pinned.what, pinned.path), None)
        if digest is None:
            raise ManifestSignatureError(
                SignatureProblem.FILES_CHANGED,
                f"{sig} does not cover {pinned.what} = {pinned.path!r} that {manifest_path} names: the "
                f"organizer must sign again with {_sign_fix(manifest_path)}",
            )
        if not pinned.resolved.is_file():
            absent.append(pinned.what)
            continue
        if file_sha256(pinned.resolved) != digest:
            raise ManifestSignatureError(
                SignatureProblem.FILES_CHANGED,
                f"your copy of {pinned.what} ({pinned.resolved}) differs from the one the organizer signed "
                f"in {sig}: download it again from the run's organizer",
            )
        checked.append(pinned.what)
    if signed:
        extra = ", ".join(what for what, _ in signed)
        raise ManifestSignatureError(
            SignatureProblem.FILES_CHANGED,
            f"{sig} signs files ({extra}) that {manifest_path} does not name: the organizer must sign again "
            f"with {_sign_fix(manifest_path)}",
        )
    return Verified(record.signer, tuple(checked), tuple(absent))


_warned: set[Path] = set()


def has_warned(manifest_path: str | Path) -> bool:
    """Whether this process already said something about the unsigned manifest at `manifest_path`."""
    return Path(manifest_path).resolve() in _warned


def mark_warned(manifest_path: str | Path) -> None:
    """Record that this process said its line about `manifest_path` (this module's warning or a caller's own,
    such as preflight's note on a packaged example), so `load_run_manifest` does not warn about it again."""
    _warned.add(Path(manifest_path).resolve())


def untrusted_warning(manifest_path: Path, manifest: RunManifest) -> str:
    """The one warning for a manifest without an authority (private experiments)."""
    who = (
        "only its trust.synchronizers may hold the synchronizer role, but nothing proves this copy is "
        "the organizer's"
        if manifest.trust.synchronizers
        else "any peer can take over this run (hold the synchronizer role and publish the model's updates)"
    )
    return (
        f"warning: {manifest_path} has no [trust] authority, so it is unsigned and {who}; fine for a private "
        "experiment, not for a run open to strangers: for one, its organizer "
        "adds [trust] authority = the peer "
        "ID of `p2p-diloco keygen --out org.key` (and synchronizers = the peer IDs that may synchronize) and "
        f"signs it with `p2p-diloco manifest sign {manifest_path} --identity org.key` "
        "(`p2p-diloco manifest sign --help`)"
    )


def dense_trust_line(manifest: RunManifest) -> str | None:
    """The one line `join` prints at start when a public run merges dense updates (issue #41), else None.

    Public here: signed (`[trust] authority`), or open to any learner with named synchronizers (an unsigned
    manifest without synchronizers already warns that any peer can take the run over). Under a dense codec
    (int8, fp32) the holder publishes the merged gradient itself, so a listed synchronizer's key can publish
    any update that passes the replicas' bounds; under a sparse codec every replica merges the listed signed
    deltas itself (union rounds) and refuses a record whose result differs ("merge mismatch")."""
    trust = manifest.trust
    open_run = trust.public or (trust.learners == LEARNERS_ANY and bool(trust.synchronizers))
    if manifest.wire.codec.sparse or not open_run:
        return None
    listed = list(trust.synchronizers)
    who = ", ".join(listed[:3]) + (f" and {len(listed) - 3} more" if len(listed) > 3 else "")
    return (
        f"note: run {manifest.run_id} merges dense {manifest.wire.codec} updates, so its listed "
        f"synchronizers ({who}) are trusted with the model: a holder's update is applied as published, "
        'within the replicas\' bounds; with a sparse codec (e.g. [wire] codec = "topk4k-int2") every '
        "replica merges the learners' signed deltas itself (docs/public_run.md, union rounds)"
    )


def load_run_manifest(path: str | Path, *, err: TextIO | None = None, warn: bool = True) -> RunManifest:
    """Load a manifest for `join`, `status`, `bootstrap` or `export`: verify it when it names an authority
    (`ManifestSignatureError` otherwise), else warn once per process and manifest on `err` (stderr);
    `warn=False` for processes whose sibling warns already (island ranks other than 0)."""
    path = Path(path)
    blob, manifest = read_manifest(path)
    if manifest.trust.public:
        _verify(path, blob, manifest)
    elif warn and not has_warned(path):
        mark_warned(path)
        print(untrusted_warning(path, manifest), file=err or sys.stderr, flush=True)
    return manifest


def cli_manifest(args: argparse.Namespace) -> int:
    """`p2p-diloco manifest sign MANIFEST --identity KEY [--out SIG]` / `manifest verify MANIFEST`."""
    if args.manifest_command == "sign":
        target, record = sign_manifest(args.manifest, args.identity, out=args.out)
        print(
            f"wrote {target}: run {record.run_id} (manifest {record.manifest_hash}) signed by {record.signer}"
        )
        for what, path, digest in record.files:
            print(f"  pins {what} {path}: sha256 {digest[:16]}")
        print(f"publish {Path(args.manifest).name} and {target.name} together", flush=True)
        return 0
    blob, manifest = read_manifest(args.manifest)
    if not manifest.trust.public:
        print(untrusted_warning(Path(args.manifest), manifest), file=sys.stderr)
        return 1
    verified = _verify(Path(args.manifest), blob, manifest)
    print(
        f"{args.manifest}: signed by the authority {verified.signer}; run {manifest.run_id} "
        f"(manifest {manifest.manifest_hash}); check that this authority is the organizer's published peer ID"
    )
    if verified.checked:
        print(f"  files match: {', '.join(verified.checked)}")
    if verified.absent:
        print(f"  not here, not checked: {', '.join(verified.absent)}")
    return 0
