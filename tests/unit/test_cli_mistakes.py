"""Issue #32's list of mistakes: each one gets a message that says what is wrong and how to fix it, and exit
status 2 (one test per case). The cases that need live daemons are in
tests/integration/test_cli_mistakes_daemons.py."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from p2p_diloco.cli import build_parser, main
from p2p_diloco.config import ModelKind
from p2p_diloco.net.identity import write_identity

GOOD_PEER = "/ip4/127.0.0.1/tcp/5/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


def run(argv: list[str], capsys) -> tuple[int, str]:
    """Exit status and stderr of `p2p-diloco ARGV` run in this process."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    return code, capsys.readouterr().err


@pytest.fixture
def key(tmp_path: Path) -> str:
    path = tmp_path / "me.key"
    write_identity(path)
    return str(path)


def manifest(tmp_path: Path, text: str, name: str = "run.toml") -> str:
    path = tmp_path / name
    path.write_text(f'run_id = "t"\n{text}')
    return str(path)


def test_manifest_swallowed_by_initial_peers_names_the_fix(tmp_path, key, capsys):
    run_toml = manifest(tmp_path, "")
    code, err = run(
        ["join", "--initial-peers", GOOD_PEER, run_toml, "--identity", key, "--state-dir", "s"], capsys
    )
    assert code == 2
    assert f"'{run_toml}' was read as an --initial-peers address" in err
    assert "Put the manifest first" in err and f"--initial-peers ADDR -- {run_toml}" in err
    # the fixes it names do parse as meant
    args = build_parser().parse_args(
        ["join", "--identity", key, "--state-dir", "s", "--initial-peers", GOOD_PEER, "--", run_toml]
    )
    assert args.manifest == run_toml and args.initial_peers == [GOOD_PEER]


def test_string_where_a_number_belongs_names_the_key_path(tmp_path, capsys):
    code, err = run(["model-digest", manifest(tmp_path, '[model]\nblock_size = "128"\n')], capsys)
    assert code == 2
    assert "[model] block_size = '128' (a string): must be an integer" in err
    assert "write block_size = 128 under [model], without quotes" in err


def test_values_out_of_range_are_one_line_each_without_a_traceback(tmp_path, capsys):
    text = '[diloco]\nfragments = 0\nouter_lr = -1\n[wire]\ncodec = "topk-int8"\nerror_feedback = false\n'
    path = manifest(tmp_path, text)
    code, err = run(["model-digest", path], capsys)
    assert code == 2 and "Traceback" not in err and "pydantic" not in err and "validation error" not in err
    assert f"{path}: [diloco] fragments = 0: must be >= 1" in err and "set fragments under [diloco]" in err
    assert f"{path}: [diloco] outer_lr = -1: must be > 0; set outer_lr under [diloco] to a value > 0" in err


def test_unknown_hf_config_key_names_the_close_valid_one(tmp_path, capsys):
    text = '[model]\nkind = "hf"\n[model.config]\nmodel_type = "gpt2"\nvocab_size = 256\nn_layers = 2\n'
    code, err = run(["model-digest", manifest(tmp_path, text)], capsys)
    assert code == 2
    assert "has no key n_layers (did you mean n_layer?)" in err and "Fix or remove it" in err


def test_heads_that_do_not_divide_the_hidden_size_are_refused(tmp_path, capsys):
    text = (
        '[model]\nkind = "hf"\n[model.config]\nmodel_type = "qwen2"\nvocab_size = 256\nhidden_size = 100\n'
        "num_attention_heads = 3\nnum_key_value_heads = 3\nnum_hidden_layers = 1\nintermediate_size = 64\n"
    )
    code, err = run(["model-digest", manifest(tmp_path, text)], capsys)
    assert code == 2
    assert "model.config.hidden_size (100) must be a multiple of model.config.num_attention_heads (3)" in err
    assert "use num_attention_heads in" in err


def test_model_digest_prints_the_new_digest_and_says_it_differs(tmp_path, capsys):
    path = manifest(tmp_path, '[model]\nweights_digest = "0123456789abcdef"\n')
    code = main(["model-digest", path])
    out, err = capsys.readouterr()
    digest = out.split("weights_digest: ")[1].split()[0]
    assert code == 1 and len(digest) == 16 and digest != "0123456789abcdef"
    assert "it differs" in err and f'write weights_digest = "{digest}" under [model]' in err
    Path(path).write_text(f'run_id = "t"\n[model]\nweights_digest = "{digest}"\n')
    assert main(["model-digest", path]) == 0


def test_dashboard_port_in_use_names_the_flag(capsys):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code, err = run(["dashboard", "demo", "--port", str(port)], capsys)
    assert code == 2
    assert f"TCP port {port} on 127.0.0.1 is already in use" in err and "with --port" in err


def test_state_dir_that_is_a_file_is_refused(tmp_path, key, capsys):
    file = tmp_path / "state"
    file.write_text("not a directory")
    code, err = run(["join", "demo", "--identity", key, "--state-dir", str(file)], capsys)
    assert code == 2
    assert f"--state-dir {file} is a file, not a directory; give a directory" in err


def test_join_without_identity_gets_the_keygen_hint(capsys):
    code, err = run(["join", "demo", "--state-dir", "s"], capsys)
    assert code == 2
    assert "--identity KEY is missing" in err and "p2p-diloco keygen --out me.key" in err


def test_messages_show_choices_as_the_manifest_spells_them(tmp_path, capsys):
    assert repr(ModelKind.CUSTOM) == "'custom'" and f"{ModelKind.CUSTOM!r}" == "'custom'"
    code, err = run(
        ["export", "demo", "--state-dir", str(tmp_path), "--out", str(tmp_path / "hf"), "--format", "hf"],
        capsys,
    )
    assert code == 2
    assert "this one is 'gpt': use --format safetensors" in err and "<ModelKind" not in err


def test_closed_stdout_ends_without_a_traceback(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text(Path(__file__).read_text() * 40)  # enough tokens for a train and an eval split
    cmd = [sys.executable, "-m", "p2p_diloco", "data", "prepare", str(text), "--out", str(tmp_path / "data")]
    reader, writer = socket.socketpair()  # a pipe whose reader is gone before anything is written
    reader.close()
    with writer:
        result = subprocess.run(cmd, stdout=writer, stderr=subprocess.PIPE, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr
    assert "closed it early (e.g. `| head`)" in result.stderr and "redirect to a file" in result.stderr


def test_listen_port_in_use_is_refused_before_the_daemon_starts(tmp_path, key, capsys):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        listen = f"/ip4/127.0.0.1/tcp/{port}"
        code, err = run(["join", "demo", "--identity", key, "--state-dir", "s", "--listen", listen], capsys)
    assert code == 2
    assert f"TCP port {port} on 127.0.0.1 is already in use" in err and "choose a free port" in err


def test_packaged_manifest_by_name_and_missing_manifest_hint(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no peers/ folder here, as for a wheel user
    args = build_parser().parse_args(["status", "demo"])
    from p2p_diloco.preflight import check_arguments

    check_arguments(args)
    assert Path(args.manifest).name == "demo.toml" and Path(args.manifest).parent.name == "peers"
    code, err = run(["model-digest", "nosuch.toml"], capsys)
    assert code == 2
    assert "manifest nosuch.toml does not exist" in err and "demo, llama-tiny, public" in err
