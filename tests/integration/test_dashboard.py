"""`p2p-diloco dashboard` against a real swarm: a bootstrap and `join` processes on 127.0.0.1.

* `test_dashboard_page_in_headless_chromium_shows_peers_and_global_loss`: loads the page in headless
  Chromium (`--dump-dom`, after its scripts ran) and finds every peer's ID and the global eval loss the
  JSON endpoint reports. Skipped with the reason when no `chromium` is installed (`scripts/test.sh`
  installs Debian's package when it runs as root).
* `test_dashboard_keeps_working_while_the_synchronizer_and_its_entry_peer_are_killed_and_restarted`:
  the dashboard joins the DHT through one learner only; that learner and the synchronizer are SIGKILLed
  (their whole process groups) and restarted; the dashboard answers throughout and shows the failover,
  the new synchronizer, the restarted peers and an eval curve that goes on.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

from p2p_diloco.net.identity import write_identity
from tests.support.manifests import tiny_swarm_toml

pytestmark = pytest.mark.integration

LOOPBACK_LISTEN = "/ip4/127.0.0.1/tcp/0"
START_TIMEOUT = 120.0  # process start on a loaded 2-core machine: imports, DHT, catch-up
MANIFEST = tiny_swarm_toml("dash-itest")


def api(url: str, path: str = "api/summary") -> dict | None:
    """The dashboard's JSON, or None while it does not answer."""
    try:
        with urllib.request.urlopen(url + path, timeout=10) as response:
            return json.loads(response.read())
    except OSError:
        return None


class Run:
    def __init__(self, spawn, cli, wait_for, tmp_path: Path, bootstrap):  # noqa: ANN001
        self.spawn, self.cli, self.wait_for, self.tmp = spawn, cli, wait_for, tmp_path
        self.bootstrap = bootstrap
        self.manifest = tmp_path / "run.toml"
        self.manifest.write_text(MANIFEST)
        self.peers: dict[str, tuple[str, object]] = {}  # name -> (peer ID, process handle)
        self.url = ""

    def join(self, name: str, *extra: str) -> str:
        identity = self.tmp / f"{name}.key"
        peer_id = self.peers[name][0] if name in self.peers else write_identity(identity)
        cmd = self.cli(
            "join", str(self.manifest), "--initial-peers", *self.bootstrap.addresses,
            "--identity", str(identity), "--state-dir", str(self.tmp / f"state-{name}"),
            "--listen", LOOPBACK_LISTEN, "--min-step-time", "0.05", "--persist-every", "1",
            "--eval-every", "4", "--eval-batches", "2", *extra,
        )  # fmt: skip
        self.peers[name] = (peer_id, self.spawn(cmd))
        return peer_id

    def name_of(self, peer_id: str) -> str:
        return next(name for name, (pid, _) in self.peers.items() if pid == peer_id)

    def dashboard(self, *initial: str) -> str:
        handle = self.spawn(
            self.cli("dashboard", str(self.manifest), "--initial-peers", *initial, "--port", "0")
        )
        line = handle.wait_for_lines("dashboard: ", START_TIMEOUT)[0]
        self.url = line.removeprefix("dashboard: ").strip()
        self.dash = handle
        return self.url

    def wait_view(self, predicate, timeout: float, what: str) -> dict:  # noqa: ANN001
        seen: dict = {}

        def check() -> bool:
            assert self.dash.popen.poll() is None, f"the dashboard exited:\n{self.dash.stderr_tail()}"
            view = api(self.url)
            assert view is not None, "the dashboard stopped answering"
            seen.clear()
            seen.update(view)
            return bool(predicate(view))

        try:
            self.wait_for(check, timeout, what, interval=1.0)
        except TimeoutError as exc:
            summary = {k: seen.get(k) for k in ("synchronizer", "fragments", "health")}
            raise AssertionError(f"{exc}\nlast view: {json.dumps(summary)[:2000]}") from exc
        return seen


@pytest.fixture
def run(spawn, cli, wait_for, start_bootstrap, tmp_path) -> Run:  # noqa: ANN001
    return Run(spawn, cli, wait_for, tmp_path, start_bootstrap())


def live_ids(view: dict) -> set[str]:
    return {p["peer_id"] for p in view["peers"]}


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("chromium") is None,
    reason="no chromium on PATH (scripts/test.sh installs Debian's chromium when run as root)",
)
def test_dashboard_page_in_headless_chromium_shows_peers_and_global_loss(run, tmp_path):
    # with tensorboard installed, one peer also logs there (`join --log-to`), checked at the end
    tensorboard = importlib.util.find_spec("tensorboard") is not None
    logged = ("--log-to", f"tensorboard:{tmp_path / 'tb'}") if tensorboard else ()
    ids = {run.join("p0", *logged), run.join("p1")}
    url = run.dashboard(*run.bootstrap.addresses)
    view = run.wait_view(
        lambda v: live_ids(v) == ids and len(v["eval"]) >= 2 and v["contributions"],
        START_TIMEOUT,
        "both peers live, two global evaluations and a leaderboard",
    )
    dom = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000", "--dump-dom", url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    peers_table = html[html.index('id="t-peers"') :]
    for peer_id in ids:  # rendered by the page's script into the peers table
        assert f"<td>{peer_id}</td>" in peers_table, peer_id
    shown = re.search(r'id="last-loss">([0-9]+\.[0-9]+)<', html)
    assert shown is not None, "the page shows no global eval loss"
    losses = {f"{p['loss']:.4f}" for p in (api(url) or view)["eval"]} | {
        f"{p['loss']:.4f}" for p in view["eval"]
    }
    assert shown.group(1) in losses
    assert 'id="c-loss-time"' in html and "<path" in html[html.index('id="c-loss-time"') :]
    for chart in ("c-throughput", "c-train-loss"):  # the peers' tokens/s and training loss over time
        drawn = html[html.index(f'id="{chart}"') :]
        assert "<path" in drawn[: drawn.index("</svg>")], chart
    # the fragments' legend in their colours (an inline style: the label class's fill would win over an attribute)
    assert re.search(r'<text[^>]*class="lbl legend"[^>]*style="fill:#1f77b4"[^>]*>fragment 0</text>', html)
    assert re.search(r'<text[^>]*class="lbl legend"[^>]*style="fill:#ff7f0e"[^>]*>fragment 1</text>', html)
    narrow = subprocess.run(
        [
            *("chromium", "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000"),
            *("--window-size=500,3000", "--dump-dom", url),  # Chromium's narrowest window
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    widths = [int(w) for w in re.findall(r'viewBox="0 0 (\d+) 220"', narrow.stdout)]
    # six charts, each drawn within the window less its margins (a 520 px column overflowed it)
    assert len(widths) == 6 and max(widths) <= 484, widths
    if tensorboard:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        def scalars() -> set[str]:
            folders = list((tmp_path / "tb").glob("*"))
            return set(EventAccumulator(str(folders[0])).Reload().Tags()["scalars"]) if folders else set()

        wanted = {"peer/loss", "peer/tokens_per_s", "peer/merged_tokens", "global/eval_loss"}
        run.wait_for(
            lambda: wanted <= scalars(), START_TIMEOUT, f"TensorBoard scalars {sorted(wanted)}", interval=2.0
        )


@pytest.mark.soak
@pytest.mark.slow
def test_dashboard_keeps_working_while_the_synchronizer_and_its_entry_peer_are_killed_and_restarted(run):
    for i in range(3):
        run.join(f"p{i}")
    addresses = {
        name: [
            line.removeprefix("address: ").strip()
            for line in handle.wait_for_lines("address: ", START_TIMEOUT)
        ]
        for name, (_, handle) in run.peers.items()
    }
    # the dashboard enters the DHT through one learner only, which is not the synchronizer at first
    url = run.dashboard(*addresses["p0"])
    first = run.wait_view(
        lambda v: len(v["peers"]) == 3 and v["synchronizer"] and len(v["eval"]) >= 1,
        START_TIMEOUT,
        "3 live peers, a synchronizer and a global evaluation",
    )
    sync_id, term = first["synchronizer"]["peer_id"], first["synchronizer"]["term"]
    sync_name = run.name_of(sync_id)
    entry = "p0" if sync_name != "p0" else "p1"
    assert api(url) is not None
    run.peers[sync_name][1].kill_group()
    after_failover = run.wait_view(
        lambda v: v["synchronizer"] and v["synchronizer"]["term"] > term and sync_id not in live_ids(v),
        START_TIMEOUT,
        "a new synchronizer with a higher term, the old one gone",
    )
    assert any(m["kind"] == "failover" and m["from"] == sync_id for m in after_failover["versions"]["marks"])
    evals_before = len(after_failover["eval"])

    run.peers[entry][1].kill_group()  # now the peer the dashboard entered the DHT through
    entry_id = run.peers[entry][0]
    run.wait_view(
        lambda v: entry_id not in live_ids(v) and len(v["peers"]) == 1, START_TIMEOUT, "one peer left"
    )

    for name in (sync_name, entry):  # both come back with their keys and state directories
        run.join(name)
    everyone = {pid for pid, _ in run.peers.values()}
    final = run.wait_view(
        lambda v: live_ids(v) == everyone and len(v["eval"]) > evals_before + 1,
        START_TIMEOUT,
        "all 3 peers live again and the eval curve going on",
    )
    assert final["synchronizer"]["term"] > term
    assert [p["t"] for p in final["eval"]] == sorted(p["t"] for p in final["eval"])
    evaluators = {p["evaluator"] for p in final["eval"]}
    assert sync_id in evaluators and len(evaluators) >= 2  # the old synchronizer's points and its successor's
    assert final["health"]["polls"] > first["health"]["polls"]
