"""The viewer page in real headless Chromium (Debian's /usr/bin/chromium driven by playwright).

With SKYCAP_SCREENSHOTS=1 it also refreshes the screenshots of the main views in
docs/images/ for the README; otherwise they go to a temporary folder, so a test run never
changes the repository.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_viewer_fixtures import MIXED, grpo_id, make_runs

from skycap.viewer.server import ViewerServer, make_server

CHROMIUM = Path("/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DOCS_IMAGES = Path(__file__).resolve().parent.parent / "docs" / "images"
TIMEOUT_MS = 10_000

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="/usr/bin/chromium is absent (apt-get install chromium; .ci/run installs it)",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ViewerServer]:
    runs = make_runs(tmp_path_factory.mktemp("browser"))
    srv = make_server([runs["grpo"].parent], port=0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def page(server: ViewerServer, images: Path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        context = browser.new_context(viewport={"width": 1500, "height": 900})
        context.set_default_timeout(TIMEOUT_MS)
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.errors = errors
        page.images = images
        yield page
        browser.close()


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if os.environ.get("SKYCAP_SCREENSHOTS") == "1":
        return DOCS_IMAGES
    return tmp_path_factory.mktemp("screenshots")


def shot(page, name: str) -> None:
    page.screenshot(path=str(page.images / f"viewer-{name}.png"))


def query(page) -> dict[str, str]:
    return dict(httpx.URL(page.url).params)


def test_open_run_group_rollout_token_fork_and_reload(server: ViewerServer, page):
    page.goto(server.url)
    page.wait_for_selector("tr.group")
    assert page.locator("tr.group").count() == 5
    assert page.locator("#health .chip").count() == 5
    assert query(page)["run"] == "grpo"

    page.click('tr.group[data-key="1~a"]')
    page.wait_for_selector("tr.group-body tr.rollout")
    assert page.locator("tr.group-body tr.rollout").count() == 4
    assert query(page)["group"] == "1~a"
    shot(page, "groups")

    doc_id = grpo_id(1, "a", 0, 0)
    page.click(f'tr.group-body tr[data-id="{doc_id}"] a')
    page.wait_for_selector(".tv .ln.k-sampled .t")
    assert query(page)["open"] == doc_id

    token = page.locator(".tv .ln.k-sampled .t").nth(2)
    index = int(token.get_attribute("data-i"))
    token.hover()
    page.wait_for_selector("#tooltip:not([hidden]) .tt-logprob")
    path = httpx.get(f"{server.url}api/v1/runs/grpo/trajectories/{doc_id}/paths/0").json()
    logprob = path["token_data"]["logprobs"][index]
    assert page.inner_text("#tooltip .tt-logprob") == f"{logprob:.4f}"
    assert page.inner_text("#tooltip .tt-id") == str(path["token_data"]["ids"][index])
    shot(page, "path")

    page.click('.tabs .tab[data-tab="tree"]')
    page.wait_for_selector(".tree .branch-point")
    shot(page, "tree")

    page.click('.tabs .tab[data-tab="forks"]')
    page.wait_for_selector(".fork-cols")
    assert "Last common node: n0" in page.inner_text(".fork-summary")
    assert page.inner_text(".train-once").startswith("Train-once holds: each of the 4 model")
    page.select_option("select.fork-fb", "0")
    page.select_option("select.fork-fa", "1")
    page.wait_for_function("new URL(location).searchParams.get('fa') === '1'")
    shot(page, "forks")

    before = page.url
    page.reload()
    page.wait_for_selector(".fork-cols")
    assert page.url == before
    assert page.locator('.tabs .tab.active[data-tab="forks"]').count() == 1
    assert page.input_value("select.fork-fa") == "1"
    assert page.locator("tr.group-body").count() == 1  # the open group survives a reload
    assert page.errors == []


def test_keyboard_filters_health_band_and_text_only_fallback(server: ViewerServer, page):
    page.goto(f"{server.url}?run=mixed")
    page.wait_for_selector("tr.rollout")
    assert page.locator("tr.rollout").count() == len(MIXED)
    page.click('#health .chip[data-flag="forked"]')
    page.wait_for_function("new URL(location).searchParams.get('flag') === 'forked'")
    page.wait_for_function(f"document.querySelectorAll('tr.rollout').length < {len(MIXED)}")
    forked = page.locator("tr.rollout").count()
    assert forked == sum(
        1 for row in page.locator("tr.rollout").all() if "forked" in row.inner_text()
    )
    shot(page, "rollouts")

    page.keyboard.press("j")
    page.keyboard.press("j")
    cursor = page.get_attribute("tr.cursor", "data-id")
    page.keyboard.press("Enter")
    page.wait_for_function(f"new URL(location).searchParams.get('open') === '{cursor}'")
    page.wait_for_selector("#drawer:not([hidden]) .dr-head")
    page.keyboard.press("Escape")
    page.wait_for_selector("#drawer", state="hidden")
    assert "open" not in query(page)

    page.fill('#filters input[name="q"]', MIXED["text_linear"])
    page.press('#filters input[name="q"]', "Enter")
    page.wait_for_function("new URL(location).searchParams.get('q') !== null")

    mirror = grpo_id(1, "b", 0, 0)
    page.goto(f"{server.url}?run=mirror&view=rollouts&open={mirror}")
    page.wait_for_selector(".tv .ln")
    assert "tokens sidecar missing: showing message text only" in page.inner_text("#drawer")
    assert page.locator(".tv .t").count() == 0  # message text, no token spans

    page.click("#theme")
    assert page.get_attribute("html", "data-theme") in ("dark", "light")
    page.goto(f"{server.url}?run=grpo&open={grpo_id(2, 'a', 0, 1)}&group=2~a")
    page.wait_for_selector(".tv .t")
    shot(page, "dark" if page.get_attribute("html", "data-theme") == "dark" else "light")
    assert page.errors == []


def test_skycap_view_of_an_s3_mirror_lists_and_opens_records(
    server: ViewerServer, page, s3, tmp_path: Path
) -> None:
    """The real `skycap view s3://…` command, storage options from the environment."""
    import json
    import subprocess
    import sys

    from mirror_fixtures import s3_options
    from server_fixtures import wait_for

    grpo = Path(server.viewer.index.runs["grpo"].path)
    bucket = s3.bucket()
    for path in sorted(grpo.iterdir()):  # sidecars before documents, as the mirror copies
        if path.name.endswith(".zst") and not path.name.endswith(".json.zst"):
            s3.client.put_object(Bucket=bucket, Key=f"grpo/{path.name}", Body=path.read_bytes())
    for path in sorted(grpo.glob("*.json.zst")):
        s3.client.put_object(Bucket=bucket, Key=f"grpo/{path.name}", Body=path.read_bytes())
    env = {
        **os.environ,
        "SKYCAP_STORAGE_OPTIONS": json.dumps(s3_options(s3.endpoint)),
        "SKYCAP_CACHE_DIR": str(tmp_path / "cache"),
    }
    command = [
        sys.executable,
        "-m",
        "skycap.cli.main",
        "view",
        f"s3://{bucket}/grpo",
        "--port",
        "0",
    ]
    viewer = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = wait_for(viewer.stdout.readline, 60, "skycap view's start line")
        documents = len(list(grpo.glob("*.json.zst")))
        assert f"1 run(s), {documents} record(s) at http://" in line, line
        url = line.split(" at ")[1].split()[0]
        page.goto(url)
        page.wait_for_selector("tr.group")
        assert page.locator("tr.group").count() == 5
        doc_id = grpo_id(1, "a", 0, 0)
        page.click('tr.group[data-key="1~a"]')
        page.click(f'tr.group-body tr[data-id="{doc_id}"] a')
        page.wait_for_selector(".tv .ln.k-sampled .t")
        assert page.errors == []
    finally:
        viewer.terminate()
        viewer.wait(10)
