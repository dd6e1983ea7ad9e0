"""`p2p-diloco export --format hf`: the global model of an ``hf`` run as a folder transformers loads.

Owns `export_hf`: the persisted replica of a peer's state directory (`export.load_global_replica`,
checked against the manifest) is loaded into the manifest's transformers model (built from its config,
parameter names without the ``hf.`` wrapper prefix) and written with `save_pretrained`; the run's
tokenizer (the ``tokenizer.json`` copy in the prepared shards folder) is written beside it with
`PreTrainedTokenizerFast.save_pretrained`, so `AutoModelForCausalLM.from_pretrained(DIR)` and
`AutoTokenizer.from_pretrained(DIR)` both load it, offline. ``p2p_diloco_export.json`` records the run,
manifest hash, fragment versions and replica digest. The folder is written beside `out` and renamed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from p2p_diloco.config import DataSource, ModelKind, RunManifest
from p2p_diloco.model.external import HF_PREFIX, hf_config
from p2p_diloco.model.shards import TOKENIZER_FILE, read_index
from p2p_diloco.node.export import ExportError, load_global_replica

EXPORT_INFO = "p2p_diloco_export.json"


def _save_tokenizer(manifest: RunManifest, out: Path) -> None:
    data = manifest.data
    if data.source != DataSource.SHARDS:
        return  # bytes of text: no tokenizer file to ship (ids are UTF-8 bytes)
    folder = data.path(data.shards)
    index = read_index(folder)
    if index["tokenizer"]["kind"] != "file":
        return
    from transformers import PreTrainedTokenizerFast

    eos_id = index["tokenizer"].get("eos_id")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / TOKENIZER_FILE))
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
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(str(tmp))
        _save_tokenizer(manifest, tmp)
        info = {
            "run_id": manifest.run_id,
            "manifest_hash": manifest.manifest_hash,
            "versions": list(replica.versions()),
            "digest": replica.digest(),
        }
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=1) + "\n")
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        os.replace(tmp, out)
    except OSError as exc:
        raise ExportError(f"cannot write {out}: {exc.strerror or exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
