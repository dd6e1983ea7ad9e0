"""`p2p-diloco export`: write the current global model of a peer's state directory as safetensors, or
(``--format hf``, `export_hf`) as a folder transformers loads.

The global model is the persisted replica (``replica/``, written by a running or stopped `join`),
not the peer's local training weights. The fragment plan comes from the manifest's model shapes (built
on the meta device: no weights are initialized), exactly as `join` builds it, so a replica from another
model or fragment layout is refused. ``peer_state.json``, when present, must name the manifest's run
and hash. Reading is safe while the peer runs (the replica is replaced atomically); the output is
written to a temporary file and renamed, and an existing file is kept unless `force`.

The safetensors metadata (all strings) holds: format, run_id, manifest_hash, versions and checksums
(JSON lists, one per fragment), digest (of the whole replica, as `status` shows it), peer_id and
saved_at (from ``peer_state.json``, empty if absent) and model (the manifest's model section, JSON).

``--format hf`` (a run of ``[model] kind = "hf"``): the replica is loaded into the manifest's
transformers model (built from its config, parameter names without the ``hf.`` wrapper prefix) and
written with `save_pretrained`; the run's tokenizer (the ``tokenizer.json`` copy in the prepared shards
folder) is written beside it with `PreTrainedTokenizerFast.save_pretrained`, so
`AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)` both load it,
offline. The model config's (and generation config's) ``bos/eos/pad_token_id`` are the tokenizer's
end-of-text id (the tokenizer's bos, eos and pad), or None when the run has none (bytes of text), never a
config default such as GPT-2's 50256 outside the vocabulary. ``p2p_diloco_export.json`` records the run,
manifest hash, fragment versions and replica digest. The folder is written beside `out` and renamed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from p2p_diloco.config import DataSource, ModelKind, RunManifest
from p2p_diloco.errors import ConfigError
from p2p_diloco.files import atomic_path
from p2p_diloco.model.external import HF_PREFIX, build_skeleton, hf_config
from p2p_diloco.model.gpt import GPT
from p2p_diloco.model.shards import TOKENIZER_FILE, read_index
from p2p_diloco.net.manifest_signature import load_run_manifest
from p2p_diloco.node.replica_store import ReplicaFileError, ReplicaStore
from p2p_diloco.node.state import PEER_STATE_FILE, REPLICA_DIR
from p2p_diloco.protocol.fragments import FragmentPlan, plan_fragments
from p2p_diloco.protocol.replica import GlobalReplica

EXPORT_FORMAT = "p2p_diloco.global_model.v1"
EXPORT_INFO = "p2p_diloco_export.json"  # --format hf: the run, manifest hash, versions and digest


class ExportError(ConfigError):
    """The state directory, manifest or output path does not allow an export; the message says why."""


def model_plan(manifest: RunManifest) -> FragmentPlan:
    """The fragment plan `join` uses for this manifest, from parameter shapes only."""
    if manifest.model.kind == ModelKind.GPT:
        with torch.device("meta"):
            model = GPT(manifest.model)
    else:
        model = build_skeleton(manifest.model)
    shapes = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    return plan_fragments(shapes, manifest.diloco.fragments, manifest.diloco.fragment_pattern)


def load_global_replica(
    manifest: RunManifest, state_dir: str | os.PathLike[str]
) -> tuple[GlobalReplica, dict]:
    """The persisted replica of `state_dir` and its peer state (``{}`` if absent); `ExportError` if
    unusable."""
    directory = Path(state_dir)
    if not directory.is_dir():
        raise ExportError(f"--state-dir {directory} does not exist or is not a directory")
    peer_state: dict[str, Any] = {}
    state_file = directory / PEER_STATE_FILE
    if state_file.exists():
        try:
            peer_state = json.loads(state_file.read_text())
            run_id, manifest_hash = peer_state["run_id"], peer_state["manifest_hash"]
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise ExportError(f"{state_file} is unreadable ({exc})") from exc
        if (run_id, manifest_hash) != (manifest.run_id, manifest.manifest_hash):
            raise ExportError(
                f"--state-dir {directory} belongs to run {run_id!r} with manifest {manifest_hash}, not run "
                f"{manifest.run_id!r} with manifest {manifest.manifest_hash}: "
                "pass the manifest that peer joined with"
            )
    store = ReplicaStore(directory / REPLICA_DIR)
    if not store.exists():
        raise ExportError(
            f"--state-dir {directory} holds no replica ({REPLICA_DIR}/): a peer writes it "
            "every --persist-every seconds and when it stops"
        )
    try:
        replica = store.load(model_plan(manifest))
    except ReplicaFileError as exc:
        raise ExportError(f"cannot export: {exc}") from exc
    return replica, peer_state


def export_model(
    manifest: RunManifest,
    state_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    force: bool = False,
) -> dict[str, str]:
    """Write the global model of `state_dir` to `out` (safetensors); returns the metadata written."""
    out = Path(out)
    if out.exists() and not force:
        raise ExportError(f"{out} exists; pass --force to overwrite it")
    if out.exists() and out.is_dir():
        raise ExportError(f"{out} is a directory; --out takes a file name")
    if not out.parent.is_dir():
        raise ExportError(f"the folder of --out {out} does not exist")
    replica, peer_state = load_global_replica(manifest, state_dir)
    tensors = {name: t.contiguous() for name, t in replica.export_params().items()}
    metadata = {
        "format": EXPORT_FORMAT,
        "run_id": manifest.run_id,
        "manifest_hash": manifest.manifest_hash,
        "versions": json.dumps(list(replica.versions())),
        "checksums": json.dumps([replica.checksum(p) for p in range(replica.num_fragments)]),
        "digest": replica.digest(),
        "peer_id": str(peer_state.get("peer_id", "")),
        "saved_at": str(peer_state.get("saved_at", "")),
        "model": json.dumps(dataclasses.asdict(manifest.model), sort_keys=True),
    }
    try:
        with atomic_path(out) as tmp:
            save_file(tensors, str(tmp), metadata=metadata)
    except OSError as exc:
        raise ExportError(f"cannot write {out}: {exc.strerror or exc}") from exc
    return metadata


SPECIAL_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def run_tokenizer(manifest: RunManifest) -> tuple[Path | None, int | None]:
    """The run's tokenizer file (None for bytes of text) and its end-of-text id (None if it has none)."""
    data = manifest.data
    if data.source != DataSource.SHARDS:
        return None, None  # bytes of text: no tokenizer file to ship (ids are UTF-8 bytes)
    folder = data.path(data.shards)
    entry = read_index(folder)["tokenizer"]
    if entry["kind"] != "file":
        return None, None
    return folder / TOKENIZER_FILE, entry.get("eos_id")


def set_special_tokens(model: Any, eos_id: int | None) -> None:
    """The model's bos/eos/pad ids (config and generation config) as the exported tokenizer has them."""
    for config in (model.config, getattr(model, "generation_config", None)):
        if config is not None:
            for key in SPECIAL_TOKEN_IDS:
                setattr(config, key, eos_id)


def _save_tokenizer(manifest: RunManifest, out: Path, tokenizer_file: Path, eos_id: int | None) -> None:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file))
    if eos_id is not None:
        eos = tokenizer.convert_ids_to_tokens(eos_id)
        tokenizer.eos_token = eos
        tokenizer.bos_token = eos
        tokenizer.pad_token = eos
    tokenizer.model_max_length = manifest.model.block_size
    tokenizer.save_pretrained(str(out))


def export_hf(
    manifest: RunManifest,
    state_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    force: bool = False,
) -> Path:
    """Write the global model (and tokenizer) of `state_dir` to the folder `out` (module docstring)."""
    if manifest.model.kind != ModelKind.HF:
        raise ExportError(
            f"--format hf needs a run with [model] kind = 'hf'; this one is {manifest.model.kind!r}: "
            "use --format safetensors"
        )
    out = Path(out)
    if out.exists() and not force:
        raise ExportError(f"{out} exists; pass --force to overwrite it")
    if not out.parent.is_dir():
        raise ExportError(f"the folder of --out {out} does not exist")
    replica, _ = load_global_replica(manifest, state_dir)
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(hf_config(manifest.model), dtype=torch.float32)
    state = {name.removeprefix(HF_PREFIX): t for name, t in replica.export_params().items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - {
        name for name, _ in model.named_parameters()
    }
    missing = [m for m in missing if m not in tied]
    if missing or unexpected:
        raise ExportError(
            f"the replica does not fit the manifest's transformers model (missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}): pass the manifest that peer joined with"
        )
    tokenizer_file, eos_id = run_tokenizer(manifest)
    set_special_tokens(model, eos_id)
    try:
        with atomic_path(out) as tmp:
            model.save_pretrained(str(tmp))
            if tokenizer_file is not None:
                _save_tokenizer(manifest, tmp, tokenizer_file, eos_id)
            info = {
                "run_id": manifest.run_id,
                "manifest_hash": manifest.manifest_hash,
                "versions": list(replica.versions()),
                "digest": replica.digest(),
            }
            (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=1) + "\n")
            if out.exists():  # the new folder replaces only a missing one
                shutil.rmtree(out) if out.is_dir() else out.unlink()
    except OSError as exc:
        raise ExportError(f"cannot write {out}: {exc.strerror or exc}") from exc
    return out


def cli_export(args: argparse.Namespace) -> int:
    """`p2p-diloco export MANIFEST --state-dir DIR --out FILE [--force]`."""
    manifest = load_run_manifest(args.manifest)
    if getattr(args, "format", "safetensors") == "hf":
        export_hf(manifest, args.state_dir, args.out, force=args.force)
        print(f"wrote {args.out}: transformers model and tokenizer of run {manifest.run_id}", flush=True)
        return 0
    metadata = export_model(manifest, args.state_dir, args.out, force=args.force)
    print(
        f"wrote {args.out}: global model of run {metadata['run_id']} (manifest {metadata['manifest_hash']}), "
        f"versions {json.loads(metadata['versions'])}, digest {metadata['digest'][:16]}",
        flush=True,
    )
    return 0
