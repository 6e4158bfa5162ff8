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


# -- papercuts: one test per fix --------------------------------------------------------------


def test_reward_colours_keep_the_run_range_under_a_filter(server: ViewerServer, page):
    page.goto(f"{server.url}?run=grpo&view=rollouts&ann=reward=1")
    page.wait_for_selector("tr.rollout td.reward .dot")
    # Only rewards of 1 are listed; on the run's 0..1 range they are green, not the midpoint.
    styles = {d.get_attribute("style") for d in page.locator("tr.rollout td.reward .dot").all()}
    assert styles == {"background:hsl(120 65% 45%)"}
    assert page.errors == []


def test_the_task_filter_matches_the_raw_meta_task(server: ViewerServer, page):
    page.goto(f"{server.url}?run=grpo&view=rollouts&task=tasks/a")
    page.wait_for_selector("tr.rollout")
    tasks = {cell.inner_text() for cell in page.locator("tr.rollout td.task").all()}
    assert tasks == {"a.json"}  # shown as its base name, found by the raw `tasks/a.json`
    assert page.errors == []


def test_the_run_list_says_rollouts_and_mode(server: ViewerServer, page):
    page.goto(server.url)
    page.wait_for_selector('#runs .run[data-run="grpo"]')
    grpo = page.inner_text('#runs .run[data-run="grpo"] .run-meta')
    assert grpo == "20 rollouts, tokens mode"
    mixed = page.inner_text('#runs .run[data-run="mixed"] .run-meta')
    assert mixed.startswith("17 rollouts: ") and mixed.endswith(" mode") and "2 text" in mixed


def test_every_column_sorts_and_a_meta_key_becomes_a_column(server: ViewerServer, page):
    page.goto(f"{server.url}?run=grpo&view=rollouts")
    page.wait_for_selector("tr.rollout")
    for sort in ("paths", "trainable", "status", "stop_reason"):
        page.click(f'.grid.rollouts th[data-sort="{sort}"]')
        page.wait_for_function(f"new URL(location).searchParams.get('sort') === '{sort}'")
        page.wait_for_selector(f'.grid.rollouts th.sorted[data-sort="{sort}"]')
    assert query(page)["order"] == "asc"  # text columns start ascending
    stops = [row.inner_text() for row in page.locator("tr.rollout td:nth-child(10)").all()]
    assert stops == sorted(stops) and "agent_timeout" in stops
    page.click('.grid.rollouts th[data-sort="paths"]')
    page.wait_for_function("new URL(location).searchParams.get('sort') === 'paths'")
    page.wait_for_function("document.querySelector('tr.rollout td:nth-child(6)').innerText === '2'")

    page.select_option("select.add-col", "repetition_id")
    page.wait_for_function("new URL(location).searchParams.get('cols') === 'repetition_id'")
    page.click('.grid.rollouts th[data-sort="meta.repetition_id"]')
    page.wait_for_function("new URL(location).searchParams.get('sort') === 'meta.repetition_id'")
    page.wait_for_selector(".grid.rollouts th.sorted[data-sort='meta.repetition_id']")
    values = [c.inner_text() for c in page.locator("tr.rollout td.meta-col").all()]
    assert values == sorted(values, key=int) and values[0] == "0"
    page.click(".grid.rollouts th[data-sort='meta.repetition_id'] .col-remove")
    page.wait_for_function("new URL(location).searchParams.get('cols') === null")
    assert page.locator("td.meta-col").count() == 0
    assert page.errors == []


def test_the_mask_strip_shows_every_path(server: ViewerServer, page):
    forked = grpo_id(1, "a", 0, 0)
    page.goto(f"{server.url}?run=grpo&view=rollouts")
    page.wait_for_selector(f'tr.rollout[data-id="{forked}"]')
    assert page.locator(f'tr.rollout[data-id="{forked}"] .strips .strip').count() == 2
    single = grpo_id(1, "a", 1, 0)
    assert page.locator(f'tr.rollout[data-id="{single}"] .strips .strip').count() == 1


def test_an_expected_unbridged_call_says_why(server: ViewerServer, page):
    page.goto(f"{server.url}?run=mixed&view=rollouts&open={MIXED['unbridged_resample']}")
    page.wait_for_selector("#drawer:not([hidden]) .dr-flags")
    chip = page.locator('.dr-flags .flag:text-is("unbridged-expected")')
    assert chip.count() == 1 and "expected" in chip.get_attribute("title")
    assert "lvl-info" in chip.get_attribute("class")
    page.click('.tabs .tab[data-tab="tree"]')
    page.wait_for_selector(".tree")
    # Expected, not a fault: a grey note, and a grey `false · resample` in the node's calls.
    note = page.locator(".tree .sign.expected")
    assert note.all_inner_texts() == ["re-rendered as expected: resample"]
    assert page.locator(".tree .sign:not(.expected)").count() == 0
    page.click(".tree-node:has(.sign.expected)")
    assert page.locator(".tree .bridged.b-expected").inner_text() == "false · resample"
    assert page.locator(".tree .bridged.b-false").count() == 0
    page.goto(f"{server.url}?run=mixed&view=rollouts&open={MIXED['unbridged']}")
    page.wait_for_selector("#drawer:not([hidden]) .dr-flags")
    unexplained = page.locator('.dr-flags .flag:text-is("unbridged")')
    assert "lvl-warn" in unexplained.get_attribute("class")
    assert "worth a look" in unexplained.get_attribute("title")
    assert page.errors == []


def test_an_open_trajectory_says_how_to_finish_it(server: ViewerServer, page):
    page.goto(f"{server.url}?run=mixed&view=rollouts&open={MIXED['open']}")
    note = page.wait_for_selector("#drawer:not([hidden]) .open-note")
    assert f"POST /trajectories/{MIXED['open']}/finish" in note.inner_text()
    page.goto(f"{server.url}?run=mixed&view=rollouts&open={MIXED['text_linear']}")
    page.wait_for_selector("#drawer:not([hidden]) .dr-head")
    assert page.locator(".open-note").count() == 0
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


def test_the_groups_band_counts_ungrouped_failures_and_shows_them_in_one_click(
    server: ViewerServer, page
):
    """The mixed run's rollouts carry no step/instance_id: the Groups view has no rows for
    them, yet its band counts their flags and one click lists them."""
    page.goto(f"{server.url}?run=mixed&view=groups")
    hidden = page.wait_for_selector("#health .chip.hidden-rows")
    text = hidden.inner_text()
    assert text.startswith("17 ungrouped rollout(s) not shown (") and text.endswith("show them")
    assert "1 incomplete" in text and "1 failed-calls" in text
    assert page.locator('#health .chip[data-flag="failed-calls"]').count() == 1
    assert "ungrouped rollouts" in page.inner_text("#health .health-label")
    hidden.click()
    page.wait_for_selector("tr.rollout")
    assert query(page)["view"] == "rollouts" and page.locator("tr.rollout").count() == 17
    assert page.errors == []


def test_at_1024_px_the_tables_fit_and_one_arrow_marks_the_sort(server: ViewerServer, page):
    page.set_viewport_size({"width": 1024, "height": 768})
    try:
        for view in ("groups", "rollouts"):
            page.goto(f"{server.url}?run=grpo&view={view}&sort=reward&order=desc")
            page.wait_for_selector("tr.group" if view == "groups" else "tr.rollout")
            widths = page.evaluate(
                """() => {
                  const table = document.querySelector("#table table");
                  const root = document.documentElement;
                  return [root.scrollWidth, root.clientWidth, table.scrollWidth,
                          table.parentElement.clientWidth,
                          Math.ceil(table.getBoundingClientRect().right)];
                }"""
            )
            page_width, viewport, table, room, right = widths
            assert page_width <= viewport and table <= room and right <= viewport, (view, widths)
            shot(page, f"{view}-1024")
            arrows = [t for t in page.locator("thead th").all_inner_texts() if "▼" in t]
            assert len(arrows) == 1, arrows
        # Groups of one task read apart by their instance id.
        page.goto(f"{server.url}?run=grpo&view=groups")
        page.wait_for_selector("tr.group")
        steps = page.locator("tr.group td.num:nth-child(2)").all_inner_texts()
        tasks = page.locator("tr.group td.task").all_inner_texts()
        assert len(set(zip(steps, tasks, strict=True))) == len(tasks) == 5
        assert "a.json · a" in tasks
    finally:
        page.set_viewport_size({"width": 1500, "height": 900})


def test_provenance_and_tokens_coloured_by_weight_version(server: ViewerServer, page):
    """A record sampled by two weight versions: its drawer names what produced it and
    colours each sampled token by the version that sampled it."""
    from test_viewer_fixtures import Build, tid

    build = Build(tid(0xC001))
    first = build.model(build.client(None, "Count to three."), "One two three.")
    build.t.graph[first].calls[0]["weight_versions"] = [
        {"version": "3", "start": 0, "end": 2},
        {"version": "4", "start": 2, "end": build.t.graph[first].tokens.length - 3},
    ]
    build.t.provenance = {
        "skycap": "9.9",
        "tokenizer": {"name": "Qwen/Qwen3-8B", "digest": "sha256:" + "ab" * 32},
        "chat_template_digest": "sha256:" + "cd" * 32,
        "renderer": "qwen3",
        "engine": {"model": "policy", "version": "0.33.0"},
    }
    build.write(Path(server.viewer.index.runs["mixed"].path))
    server.viewer.index.refresh(force=True)  # not a rescan that may wait its interval
    page.goto(f"{server.url}?run=mixed&view=rollouts&open={build.t.id}")
    note = page.wait_for_selector("#drawer:not([hidden]) .dr-provenance")
    text = note.inner_text()
    assert "tokenizer Qwen/Qwen3-8B (abababababab)" in text and "renderer qwen3" in text
    assert "engine policy (vLLM 0.33.0)" in text
    page.wait_for_selector(".tv .ln.k-sampled .t.wv")
    assert page.locator(".tv .t.wv0").count() == 2
    assert page.locator(".tv .t.wv1").count() == build.t.graph[first].tokens.length - 5
    assert page.locator(".wv-legend .t").all_inner_texts() == ["3", "4"]
    page.locator(".tv .t.wv1").first.hover()
    assert page.wait_for_selector("#tooltip .tt-version").inner_text() == "4"
    assert page.errors == []
