"""``make ui-snapshot``: screenshots of the MLflow UI over an experiment's runs, taken with headless Chromium.

Starts ``mlflow ui`` on 127.0.0.1 (a free port) over the store, then photographs: the experiment's runs
table, its chart view, the page of each run (description, source, git commit, datasets, parameters), the
artifacts of the last run, and the comparison of all its finished runs. Chromium is Debian's package
(``apt-get install chromium``), driven by Playwright (the ``ui`` extra; Playwright's own browser download is
not used); the make target installs both. The browser starts as a researcher's would after one visit: the
sidebar on "Model training" and MLflow's assistant panel closed (both are remembered in the browser's
local storage). Writes ``<out>/*.png`` and ``<out>/PROVENANCE.json`` (run ids, the store without local
paths, the builder's provenance).

    fp8rl ui-snapshot --experiment fp8rl-demo --out results/ui
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fp8rl.tracking import store
from fp8rl.tracking.provenance import provenance

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
WIDTH = 1600
CHARTS = "rollout/entropy|rollout/reward|eval/accuracy|clip/low_neg|clip/bound"  # what the demo says to look at
LOAD_TIMEOUT_MS = 120_000  # a loaded 2-core machine renders the single-page app slowly
SETTLE_MS = 3_000  # charts animate in after their data arrives
SERVER_START_S = 90.0
# The artifact view prints the store's absolute path: shown relative to the working directory (as "./") so no
# machine's path ends up in results/.
SHOW_RELATIVE_PATHS = """root => {
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    if (node.nodeValue.includes(root)) node.nodeValue = node.nodeValue.split(root).join("./");
  }
}"""
BROWSER_STATE = """
localStorage.setItem("mlflow.workflowType_v1", JSON.stringify("machine_learning"));
localStorage.setItem("mlflow.assistant.fab.autoOpenedOnFirstLoad_v1", "true");
localStorage.setItem("mlflow.assistant.panelOpen_v1", "false");
"""


@dataclass(frozen=True)
class Page:
    name: str  # the PNG's stem
    route: str  # the UI's hash route
    ready_text: str  # text that is on the page once its data has loaded
    height: int = 1000  # of the browser window (pixels; the width is 1600)
    chart_search: str = ""  # a regular expression typed into the chart view's metric search


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def find_browser() -> str:
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    raise SystemExit("no Chromium found: install Debian's package (apt-get install chromium) or run make ui-snapshot")


def pages(experiment_id: str, runs: dict[str, str], histogram: str | None) -> list[Page]:
    """The UI routes to photograph (MLflow 3's hash routes); `runs` maps run names to ids, oldest first;
    `histogram` is an artifact of the last run to open in its artifact view."""
    base = f"/experiments/{experiment_id}"
    names, ids = list(runs), list(runs.values())
    out = [
        Page("runs_table", f"{base}/runs", names[-1]),
        Page("chart_view", f"{base}/runs?compareRunsMode=CHART", "clip/bound_low", 1500, CHARTS),
    ]
    out += [Page(f"run_{name}", f"{base}/runs/{run_id}", "arithmetic-train", 1400) for name, run_id in runs.items()]
    if histogram:
        route = f"{base}/runs/{ids[-1]}/artifacts/{histogram}"
        out.append(Page(f"run_{names[-1]}_artifacts", route, histogram, 1000))  # the preview's header
    query = f"runs={quote(json.dumps(ids))}&experiments={quote(json.dumps([experiment_id]))}"
    out.append(Page("compare_runs", f"/compare-runs?{query}", names[0], 1800))
    return out


def wait_until_up(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"mlflow ui exited with {process.returncode} before answering")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:  # noqa: S310 - our own server
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"mlflow ui did not answer on {url} within {timeout_s:.0f} s")


def photograph(browser_path: str, url: str, todo: list[Page], out_dir: Path) -> list[Path]:
    """Each page of `todo` (at `url`) as ``<out_dir>/<name>.png``, once its `ready_text` is shown. A page that
    does not load in time is photographed as it is and named in the error raised at the end."""
    from playwright.sync_api import TimeoutError as PageTimeout
    from playwright.sync_api import sync_playwright

    written, not_loaded = [], []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])  # root
        try:
            for spec in todo:
                context = browser.new_context(viewport={"width": WIDTH, "height": spec.height})
                context.add_init_script(BROWSER_STATE)
                page = context.new_page()
                try:
                    _load(page, f"{url}/#{spec.route}", spec)
                except PageTimeout:
                    not_loaded.append(spec.name)
                path = out_dir / f"{spec.name}.png"
                page.screenshot(path=str(path))
                written.append(path)
                context.close()
        finally:
            browser.close()
    if not_loaded:
        raise RuntimeError(f"not loaded within {LOAD_TIMEOUT_MS // 1000} s: {not_loaded} (see their screenshots)")
    return written


def _load(page: Any, url: str, spec: Page) -> None:
    """Open `url`, type the chart search if any, wait for the page's data, let the charts settle."""
    page.goto(url)
    if spec.chart_search:
        search = page.get_by_placeholder("Search metric charts")
        search.wait_for(timeout=LOAD_TIMEOUT_MS)
        search.fill(spec.chart_search)
    page.get_by_text(spec.ready_text).first.wait_for(timeout=LOAD_TIMEOUT_MS)
    page.wait_for_timeout(SETTLE_MS)
    page.evaluate(SHOW_RELATIVE_PATHS, f"{Path.cwd().resolve()}/")


def first_figure(tracking_uri: str, run_id: str) -> str | None:
    """The run's first ratio-histogram figure (an artifact path), or None when it logged none."""
    client = store.client(tracking_uri)
    found = client.list_artifacts(run_id, "figures/ratio_histograms")
    return min((a.path for a in found if a.path.endswith(".png")), default=None)


def experiment_runs(tracking_uri: str, experiment: str) -> tuple[str, list[Any]]:
    """The experiment's id and its finished training runs, oldest first."""
    client = store.client(tracking_uri)
    exp_id = store.experiment_id(client, experiment, create=False)
    if exp_id is None:
        raise SystemExit(f"no experiment {experiment!r} in {store.display_uri(tracking_uri)}: run `make demo` first")
    finished = [r for r in store.child_runs(client, exp_id) if r.info.status == "FINISHED"]
    if not finished:
        raise SystemExit(f"experiment {experiment!r} has no finished runs")
    return exp_id, sorted(finished, key=lambda r: r.info.start_time)


def snapshot(tracking_uri: str, experiment: str, out_dir: Path) -> list[Path]:
    """Serve the store, photograph every page (`pages`), stop the server; the PNGs and PROVENANCE.json."""
    browser = find_browser()
    exp_id, finished = experiment_runs(tracking_uri, experiment)
    runs = {r.info.run_name: r.info.run_id for r in finished}
    todo = pages(exp_id, runs, first_figure(tracking_uri, finished[-1].info.run_id))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server_command = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", tracking_uri]
    server = subprocess.Popen(  # noqa: S603 - our own command line
        [*server_command, "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        wait_until_up(url, server, SERVER_START_S)
        written = photograph(browser, url, todo, out_dir)
    finally:
        server.terminate()
        server.wait(timeout=30)
    record = {
        "experiment": experiment,
        "mlflow": store.display_uri(tracking_uri),
        "runs": runs,
        "pages": {p.name: p.route for p in todo},
        "builder": provenance(),
    }
    provenance_path = out_dir / "PROVENANCE.json"
    provenance_path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return [*written, provenance_path]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fp8rl ui-snapshot", description=__doc__.split("\n")[0])
    parser.add_argument("--experiment", default="fp8rl-demo")
    parser.add_argument("--out", type=Path, default=Path("results/ui"))
    parser.add_argument("--tracking-uri", default=None, help="default: $MLFLOW_TRACKING_URI or ./mlflow.db")
    args = parser.parse_args(argv)
    for path in snapshot(store.absolute_tracking_uri(args.tracking_uri), args.experiment, args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
