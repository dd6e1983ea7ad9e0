"""The run authority's manifest signature (`net.manifest_signature`): sign and verify, every refusal names
the file and the fix, the commands that load a run refuse an unsigned public manifest, a manifest without
an authority warns once, and the shipped example `peers/public.toml` verifies."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from p2p_diloco.cli import main
from p2p_diloco.config import RunManifest
from p2p_diloco.errors import ConfigError
from p2p_diloco.net.manifest_signature import (
    ManifestSignatureError,
    SignatureProblem,
    dense_trust_line,
    load_run_manifest,
    sign_manifest,
    signature_path,
    verify_manifest,
)
from tests.support.authority import key_file, write_public_manifest

PEERS = Path(__file__).resolve().parents[2] / "p2p_diloco" / "peers"
BOOT = "/ip4/203.0.113.7/tcp/31337/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


@pytest.fixture
def org(tmp_path):
    return key_file(tmp_path, "org")


@pytest.fixture
def signed(tmp_path, org):
    manifest = write_public_manifest(tmp_path, org.peer_id, bootstrap=(BOOT,))
    sign_manifest(manifest, org.path)
    return manifest


def refused(manifest: Path, problem: SignatureProblem) -> str:
    with pytest.raises(ManifestSignatureError) as info:
        verify_manifest(manifest)
    assert info.value.problem == problem, str(info.value)
    return str(info.value)


def test_sign_then_verify_round_trip(signed, org, capsys):
    sig = signature_path(signed)
    assert sig.name == "run.toml.sig"
    record = json.loads(sig.read_text())
    assert record["signer"] == org.peer_id and record["run_id"] == "public-test"
    verified = verify_manifest(signed)
    assert verified.signer == org.peer_id
    manifest = load_run_manifest(signed)
    assert manifest.trust.public and manifest.bootstrap == (BOOT,)
    assert capsys.readouterr().err == ""  # a valid signed manifest loads silently


@pytest.mark.parametrize(
    "edit",
    [
        lambda text: text.replace("203.0.113.7", "203.0.113.8"),  # a bootstrap address (outside the hash)
        lambda text: text + "# a comment\n",
        lambda text: text.replace("n_embd = 8", "n_embd = 9"),
    ],
    ids=["bootstrap", "comment", "setting"],
)
def test_a_changed_manifest_is_refused(signed, edit):
    signed.write_text(edit(signed.read_text()))
    message = refused(signed, SignatureProblem.MANIFEST_CHANGED)
    assert str(signed) in message and "changed after it was signed" in message
    assert "manifest sign" in message  # the organizer's fix


def test_one_flipped_byte_is_refused(signed):
    blob = bytearray(signed.read_bytes())
    blob[blob.index(b"public-test") + 1] ^= 0x01  # "ptblic-test": still a valid manifest
    signed.write_bytes(bytes(blob))
    refused(signed, SignatureProblem.MANIFEST_CHANGED)


def test_an_altered_signature_file_is_refused(signed):
    sig = signature_path(signed)
    record = json.loads(sig.read_text())
    record["sha256"] = "0" * 64  # whoever edits the manifest cannot update the signed digest
    sig.write_text(json.dumps(record))
    message = refused(signed, SignatureProblem.BAD_SIGNATURE)
    assert str(sig) in message


def test_a_signature_by_another_key_names_the_signer_and_the_authority(tmp_path, signed, org):
    mallory = key_file(tmp_path, "mallory")
    forged = write_public_manifest(tmp_path, mallory.peer_id, name="forged.toml")
    sign_manifest(forged, mallory.path, out=signature_path(signed))  # mallory's .sig beside org's manifest
    message = refused(signed, SignatureProblem.WRONG_SIGNER)
    assert f"signed by {mallory.peer_id}" in message and f"trust.authority {org.peer_id}" in message


def test_a_public_key_swapped_into_the_record_is_refused(tmp_path, signed, org):
    mallory = key_file(tmp_path, "mallory")
    forged = write_public_manifest(tmp_path, mallory.peer_id, name="forged.toml")
    sign_manifest(forged, mallory.path)
    sig = signature_path(signed)
    record = json.loads(sig.read_text())
    record["public_key"] = json.loads(signature_path(forged).read_text())["public_key"]
    sig.write_text(json.dumps(record))  # claims org as signer, carries mallory's key
    message = refused(signed, SignatureProblem.WRONG_SIGNER)
    assert mallory.peer_id in message


def test_a_missing_signature_names_the_file_and_what_to_do(tmp_path, org):
    manifest = write_public_manifest(tmp_path, org.peer_id)
    message = refused(manifest, SignatureProblem.MISSING)
    assert "run.toml.sig is missing" in message
    assert "from the run's organizer" in message and "p2p-diloco manifest sign" in message


@pytest.mark.parametrize("content", ["", "{", '{"format": "something else"}', "x" * 70_000])
def test_a_malformed_signature_file_is_refused(signed, content):
    signature_path(signed).write_text(content)
    assert str(signature_path(signed)) in refused(signed, SignatureProblem.MALFORMED)


def test_only_the_authority_may_sign(tmp_path, org):
    mallory = key_file(tmp_path, "mallory")
    manifest = write_public_manifest(tmp_path, org.peer_id)
    with pytest.raises(ManifestSignatureError, match=f"is peer {mallory.peer_id}.*authority {org.peer_id}"):
        sign_manifest(manifest, mallory.path)
    assert not signature_path(manifest).exists()


def test_signing_a_manifest_without_an_authority_says_how_to_add_one(tmp_path, org):
    manifest = tmp_path / "private.toml"
    manifest.write_text('run_id = "private"\n')
    with pytest.raises(ManifestSignatureError, match=f'authority = "{org.peer_id}"'):
        sign_manifest(manifest, org.path)


def test_a_manifest_without_an_authority_loads_with_exactly_one_warning(tmp_path, capsys):
    manifest = tmp_path / "private.toml"
    manifest.write_text('run_id = "private"\n')
    for _ in range(3):
        assert load_run_manifest(manifest).run_id == "private"
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and err.endswith("\n") and err.count("\n") == 1
    assert "any peer can take over this run" in err and str(manifest) in err


def test_data_files_are_pinned_by_content(tmp_path, org):
    (tmp_path / "train.txt").write_text("the run's text\n" * 100)
    manifest = write_public_manifest(tmp_path, org.peer_id, data='source = "files"\npaths = ["train.txt"]')
    sign_manifest(manifest, org.path)
    assert verify_manifest(manifest).checked == ("data.paths[0]",)
    (tmp_path / "train.txt").write_text("someone else's text\n" * 100)  # same path, other content
    message = refused(manifest, SignatureProblem.FILES_CHANGED)
    assert "your copy of data.paths[0]" in message and "train.txt" in message
    (tmp_path / "train.txt").unlink()  # a peer without the file (status) is not refused for it
    assert verify_manifest(manifest).absent == ("data.paths[0]",)


def test_the_shards_index_is_pinned_by_content(tmp_path, org):
    (tmp_path / "data").mkdir()
    index = tmp_path / "data" / "index.json"
    index.write_text('{"format": "p2p_diloco.tokens.v1"}')
    data = 'source = "shards"\nshards = "data"\ndigest = "0123456789abcdef"'
    manifest = write_public_manifest(tmp_path, org.peer_id, data=data)
    sign_manifest(manifest, org.path)
    assert verify_manifest(manifest).checked == ("data.shards index",)
    index.write_text('{"format": "p2p_diloco.tokens.v1", "train": []}')
    assert "index.json" in refused(manifest, SignatureProblem.FILES_CHANGED)


def test_signing_refuses_missing_data_files(tmp_path, org):
    manifest = write_public_manifest(tmp_path, org.peer_id, data='source = "files"\npaths = ["nowhere.txt"]')
    with pytest.raises(ConfigError, match="nowhere.txt"):
        sign_manifest(manifest, org.path)


def test_cli_manifest_sign_and_verify(tmp_path, org, capsys):
    manifest = write_public_manifest(tmp_path, org.peer_id)
    assert main(["manifest", "sign", str(manifest), "--identity", str(org.path)]) == 0
    out = capsys.readouterr().out
    assert f"signed by {org.peer_id}" in out and signature_path(manifest).is_file()
    assert main(["manifest", "verify", str(manifest)]) == 0
    assert f"signed by the authority {org.peer_id}" in capsys.readouterr().out
    manifest.write_text(manifest.read_text() + "# edited\n")
    assert main(["manifest", "verify", str(manifest)]) == 2
    assert "changed after it was signed" in capsys.readouterr().err


def test_cli_manifest_verify_of_a_manifest_without_an_authority_warns_and_fails(tmp_path, capsys):
    manifest = tmp_path / "private.toml"
    manifest.write_text('run_id = "private"\n')
    assert main(["manifest", "verify", str(manifest)]) == 1
    err = capsys.readouterr().err
    assert "has no [trust] authority" in err
    # the fix names commands a volunteer with only the wheel has, not the repository's docs/security.md
    assert f"`p2p-diloco manifest sign {manifest} --identity org.key`" in err and "docs/" not in err


def test_cli_manifest_sign_with_a_wrong_key_fails_cleanly(tmp_path, org, capsys):
    mallory = key_file(tmp_path, "mallory")
    manifest = write_public_manifest(tmp_path, org.peer_id)
    assert main(["manifest", "sign", str(manifest), "--identity", str(mallory.path)]) == 2
    assert "p2p-diloco manifest: " in capsys.readouterr().err


def command_lines(manifest: Path, tmp_path: Path, key: Path) -> dict[str, list[str]]:
    state = str(tmp_path / "state")
    return {
        "join": ["join", str(manifest), "--identity", str(key), "--state-dir", state],
        "status": ["status", str(manifest)],
        "export": ["export", str(manifest), "--state-dir", state, "--out", str(tmp_path / "m.safetensors")],
        "bootstrap": ["bootstrap", "--manifest", str(manifest)],
    }


@pytest.mark.parametrize("command", ["join", "status", "export", "bootstrap"])
def test_commands_refuse_an_unsigned_public_manifest(tmp_path, org, capsys, command):
    manifest = write_public_manifest(tmp_path, org.peer_id)
    assert main(command_lines(manifest, tmp_path, org.path)[command]) == 2  # before any network or file work
    err = capsys.readouterr().err
    assert f"p2p-diloco {command}: " in err and "run.toml.sig is missing" in err


@pytest.mark.parametrize("command", ["join", "status", "export", "bootstrap"])
def test_commands_refuse_a_tampered_public_manifest(tmp_path, signed, org, capsys, command):
    signed.write_text(signed.read_text().replace("203.0.113.7", "198.51.100.66"))  # a hostile bootstrap
    assert main(command_lines(signed, tmp_path, org.path)[command]) == 2
    assert "changed after it was signed" in capsys.readouterr().err


def test_the_example_public_manifest_verifies(tmp_path, capsys):
    manifest = RunManifest.load(PEERS / "public.toml")
    assert manifest.trust.public and manifest.trust.synchronizers == (manifest.trust.authority,)
    assert verify_manifest(PEERS / "public.toml").signer == manifest.trust.authority
    copy = tmp_path / "renamed.toml"  # a volunteer may rename the pair: the signature covers bytes only
    shutil.copy(PEERS / "public.toml", copy)
    shutil.copy(PEERS / "public.toml.sig", signature_path(copy))
    assert load_run_manifest(copy).run_id == "public-example"
    assert capsys.readouterr().err == ""


def test_a_manifest_re_signed_under_another_authority_is_another_run(tmp_path, signed, org):
    # whoever swaps in their own authority and signs can only start a different run: the authority is
    # part of the manifest hash that every DHT key and message header carries
    mallory = key_file(tmp_path, "mallory")
    hijacked = tmp_path / "hijacked.toml"
    hijacked.write_text(signed.read_text().replace(org.peer_id, mallory.peer_id))
    sign_manifest(hijacked, mallory.path)
    assert verify_manifest(hijacked).signer == mallory.peer_id
    assert RunManifest.load(hijacked).manifest_hash != RunManifest.load(signed).manifest_hash


# ---- issue #41: a dense public run says at start who it trusts with the model -------------------------


def test_a_dense_public_run_names_its_synchronizers_as_trusted_with_the_model(tmp_path, org):
    dense = RunManifest.load(write_public_manifest(tmp_path, org.peer_id, name="dense.toml"))
    assert not dense.wire.codec.sparse
    line = dense_trust_line(dense)
    assert line is not None and org.peer_id in line and "trusted with the model" in line
    assert "\n" not in line  # one line


def test_union_rounds_and_private_runs_print_no_trust_line():
    shipped = RunManifest.load(PEERS / "public.toml")  # the packaged public run: union rounds
    assert shipped.trust.public and shipped.wire.codec.sparse
    assert dense_trust_line(shipped) is None
    private = RunManifest.load(PEERS / "demo.toml")  # no synchronizers named: it warns already
    assert dense_trust_line(private) is None
