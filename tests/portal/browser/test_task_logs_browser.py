"""The live log panel in a real browser (Chromium driven by Playwright against the control
plane under uvicorn, as the other browser tests): a tenant member opens a running task's
page while its lines are shipped through the agent's real ingestion route (POST
/api/v1/nodes/{id}/logs with the agent key), and sees them arrive without a reload, in the
page's bound; auto-scroll stops when they scroll up and resumes at the bottom; Pause holds
lines back until Resume; the search filters and marks; "Load earlier lines" reads what the
first tail left out; Download gives the whole log; the end and the exit code show when
the task completes. The panel goes on through a restart of the control plane (the browser
reconnects with Last-Event-ID: no line lost or repeated); a task that ends with no line
stored shows its final log tail. A training group's page with two ranks: every rank
interleaved with "[rank N]", or one rank. No page breaks the Content-Security-Policy.

The data the server must see is committed once for the module and removed at the end."""

from __future__ import annotations

import time

import pytest
import requests

from apps.nodes.models import Node
from apps.tasks.models import Task
from apps.tasks.services import move_tasks
from apps.tenants.services import add_member, create_tenant
from tests.factories import UserFactory, make_group, make_task, make_task_holding
from tests.headers import AGENT_HTTP
from tests.live import start_control_plane, stop_process
from tests.nodes.payloads import gpu_stat, heartbeat
from tests.portal.browser.support import (  # skips this module without a browser
    PASSWORD,
    SCREENSHOTS,
    Browser,
    beat,
    committed,
    live_portal,
    sync_api,
)

pytestmark = [pytest.mark.browser, pytest.mark.django_db]
expect = sync_api.expect
NODE = "gpu-logs-01"
BOOT = [f"boot {i:04d}" for i in range(1, 1201)]  # shipped before the page opens: more than its first tail
SERVER_ENV = {"HETEROFLOW_LOG_FOLLOW_POLL_SECONDS": "1"}  # followers look at the status every second, not 5


def setup() -> dict:
    tenant = create_tenant(name="Logline Labs", slug="logline")
    UserFactory(username="logline-dev", password=PASSWORD)
    add_member(tenant, username="logline-dev", role="member")
    node = Node.objects.get(pk=NODE)
    task = make_task(tenant, name="trainer", status="running", node=node, gpu_required=0)
    flood = make_task(tenant, name="flood", status="running", node=node, gpu_required=0)
    quiet = make_task(tenant, name="quiet", status="running", node=node, gpu_required=0)
    group = make_group(tenant, 2, 1, name="llm", members={"status": "running", "node": node})
    ranks = dict(Task.objects.filter(group=group).values_list("rank", "pk"))
    carded = make_task_holding(node, tenant, "running", card=1)  # its card's readings: a chart
    return {
        "task": task.pk,
        "flood": flood.pk,
        "quiet": quiet.pk,
        "group": group.pk,
        "ranks": ranks,
        "carded": carded.pk,
    }


class Agent:
    """Ships a task's lines as the node's agent does: one run, numbered from 0."""

    def __init__(self, url: str):
        self.url = url
        self.sent: dict[int, list[str]] = {}

    def ship(self, task_id: int, texts: list[str], stream: str = "stdout") -> None:
        sent = self.sent.setdefault(task_id, [])
        now = time.time()
        lines = [[len(sent) + i, now + i * 1e-4, stream, text] for i, text in enumerate(texts)]
        response = requests.post(
            f"{self.url}/api/v1/nodes/{NODE}/logs",
            json={"tasks": [{"task_id": task_id, "run": "r", "lines": lines}]},
            headers=AGENT_HTTP,
            timeout=30,
        )
        assert response.status_code == 200 and response.json()["refused"] == [], response.text
        sent.extend(texts)


def seed(url: str) -> dict:
    beat(url, NODE, heartbeat(gpus=2, hostname=NODE, internal_ip="10.0.0.41"))
    rows = committed(setup)
    agent = Agent(url)
    agent.ship(rows["task"], BOOT)
    return {"rows": rows, "agent": agent}


@pytest.fixture(scope="module")
def live(django_db_setup, django_db_blocker):
    # followers look at the task's status every second (5 s by default); a test restarts
    # the server (live["servers"])
    with django_db_blocker.unblock(), live_portal(seed, env=SERVER_ENV) as world:
        yield world


@pytest.fixture
def member(live):
    browser = Browser(live, "logline-dev")
    yield browser
    browser.close()


def shot(page, name: str) -> None:
    page.screenshot(path=str(SCREENSHOTS / f"logs-{name}.png"), full_page=True)


def at_bottom(page) -> bool:
    return page.eval_on_selector("[data-log-view]", "v => v.scrollHeight - v.scrollTop - v.clientHeight < 8")


def end(*task_ids) -> None:
    for task_id in task_ids:
        assert committed(move_tasks, task_id, ["running"], "completed", exit_code=0) == [task_id]


def test_a_running_tasks_log_is_followed_live(member, live):
    page, agent, task = member.page, live["agent"], live["rows"]["task"]
    panel = page.locator("[data-log-panel]")
    lines = panel.locator(".log-line")
    page.goto(f"/portal/tasks/{task}/")
    expect(panel).to_have_attribute("data-state", "live")
    # the first read is the last 1,000 lines; the follow goes on after them
    expect(lines).to_have_count(1000)
    expect(lines.first).to_have_text("boot 0201")
    expect(lines.last).to_have_text("boot 1200")
    assert at_bottom(page)

    # new lines, without a reload: stderr and the agent's own notes stand apart
    agent.ship(task, ["step 1 loss 0.9", "step 2 loss 0.8"])
    agent.ship(task, ["warning: disk slow"], stream="stderr")
    agent.ship(task, ["[… 4096 bytes dropped …]"], stream="system")
    expect(panel.locator('.log-line[data-seq="1204"]')).to_have_text("[… 4096 bytes dropped …]")
    expect(panel.locator('.log-line[data-seq="1203"]')).to_have_class("log-line stderr")
    expect(panel.locator('.log-line[data-seq="1204"]')).to_have_class("log-line system")
    colours = lines.evaluate_all(
        "ls => ls.slice(-3).map(l => getComputedStyle(l).color + ' ' + getComputedStyle(l).backgroundColor)"
    )
    assert len(set(colours)) == 3, colours
    assert at_bottom(page)
    shot(page, "task-live")

    # scrolled up: new lines are added, the view stays where the reader is
    page.eval_on_selector("[data-log-view]", "v => { v.scrollTop = 0; }")
    expect(panel).to_have_attribute("data-autoscroll", "off")
    expect(panel.locator("[data-log-scroll]")).to_be_visible()
    agent.ship(task, [f"step {i} loss 0.7" for i in range(3, 23)])
    expect(panel.locator('.log-line[data-seq="1224"]')).to_have_text("step 22 loss 0.7")
    assert page.eval_on_selector("[data-log-view]", "v => v.scrollTop") == 0
    # back at the bottom: it follows again
    page.eval_on_selector("[data-log-view]", "v => { v.scrollTop = v.scrollHeight; }")
    expect(panel).to_have_attribute("data-autoscroll", "on")
    agent.ship(task, ["step 23 loss 0.6"])
    expect(panel.locator('.log-line[data-seq="1225"]')).to_be_visible()
    assert at_bottom(page)

    # Pause holds new lines back (none dropped) until Resume
    panel.locator("[data-log-pause]").click()
    expect(panel.locator("[data-log-pause]")).to_have_text("Resume")
    agent.ship(task, ["held 1", "held 2", "held 3"])
    expect(panel).to_have_attribute("data-held", "3")
    expect(panel.locator("[data-log-held]")).to_contain_text("3 new lines held back")
    expect(panel.locator(".log-line", has_text="held")).to_have_count(0)
    panel.locator("[data-log-pause]").click()
    expect(panel.locator(".log-line", has_text="held")).to_have_count(3)
    expect(panel.locator("[data-log-held]")).to_be_hidden()
    expect(lines.last).to_have_text("held 3")

    # search: only the matching lines, the text marked in them; cleared, every line again
    panel.locator("[data-log-search]").fill("LOSS 0.7")
    visible = panel.locator(".log-line:not(.log-miss)")
    expect(visible).to_have_count(20)
    expect(panel.locator("[data-log-matches]")).to_have_text("20 of 1,028 lines match")
    expect(visible.first.locator("mark")).to_have_text("loss 0.7")
    agent.ship(task, ["step 24 loss 0.7", "unrelated"])  # lines that come meanwhile are filtered too
    expect(visible).to_have_count(21)
    shot(page, "task-search")
    panel.locator("[data-log-search]").fill("")
    expect(visible).to_have_count(1030)
    expect(panel.locator(".log-line mark")).to_have_count(0)

    # the 200 lines the first tail left out
    panel.locator("[data-log-earlier]").click()
    expect(lines).to_have_count(1230)
    expect(lines.first).to_have_text("boot 0001")
    expect(panel.locator("[data-log-earlier]")).to_be_hidden()

    # Download: the whole log, read page by page
    with page.expect_download() as download:
        panel.locator("[data-log-download]").click()
    assert download.value.suggested_filename == f"task-{task}.log"
    with open(download.value.path(), encoding="utf-8") as saved:
        assert saved.read() == "\n".join(agent.sent[task]) + "\n"
    expect(panel.locator("[data-log-info]")).to_have_text("Downloaded 1,230 lines.")

    # the task ends: the follow says so, with its exit code
    end(task)
    expect(panel.locator("[data-log-status]")).to_have_text("Ended: completed, exit code 0")
    expect(panel).to_have_attribute("data-state", "ended")
    expect(page.locator("[data-task-status]")).to_have_text("completed")
    shot(page, "task-ended")
    assert member.violations == []


def test_the_page_keeps_at_most_5000_lines_and_says_so(member, live):
    page, agent, flood = member.page, live["agent"], live["rows"]["flood"]
    panel = page.locator("[data-log-panel]")
    page.goto(f"/portal/tasks/{flood}/")
    expect(panel).to_have_attribute("data-state", "live")
    expect(panel.locator("[data-log-tail]")).to_contain_text("No output yet.")
    agent.ship(flood, [f"flood {i}" for i in range(1, 5201)])
    expect(panel.locator(".log-line").last).to_have_text("flood 5200")
    expect(panel.locator(".log-line")).to_have_count(5000)
    expect(panel.locator(".log-line").first).to_have_text("flood 201")
    expect(panel.locator("[data-log-trimmed]")).to_have_text(
        "The oldest 200 lines are no longer shown: the page keeps the latest 5,000. Download has the whole log."
    )
    assert at_bottom(page)
    with page.expect_download() as download:
        panel.locator("[data-log-download]").click()
    with open(download.value.path(), encoding="utf-8") as saved:
        assert saved.read().splitlines() == agent.sent[flood]
    assert member.violations == []


def test_a_groups_log_every_rank_or_one(member, live):
    page, agent, rows = member.page, live["agent"], live["rows"]
    first, second = rows["ranks"][0], rows["ranks"][1]
    agent.ship(first, ["r0 init"])
    agent.ship(second, ["r1 init"])
    panel = page.locator("[data-log-panel]")
    lines = panel.locator(".log-line")
    page.goto(f"/portal/training/{rows['group']}/")
    expect(panel).to_have_attribute("data-state", "live")
    expect(lines).to_have_text(["[rank 0] r0 init", "[rank 1] r1 init"])

    agent.ship(second, ["r1 step 1"])
    agent.ship(first, ["r0 step 1"])
    agent.ship(second, ["r1 oops"], stream="stderr")
    expect(lines).to_have_count(5)
    expect(lines.nth(4)).to_have_text("[rank 1] r1 oops")
    expect(lines.nth(4)).to_have_class("log-line stderr")
    shot(page, "group-all")

    # one rank: its lines only, without the prefix, and only its new ones
    panel.locator("[data-log-rank]").select_option("1")
    expect(lines).to_have_text(["r1 init", "r1 step 1", "r1 oops"])
    expect(panel).to_have_attribute("data-state", "live")
    agent.ship(first, ["r0 step 2"])
    agent.ship(second, ["r1 step 2"])
    expect(lines.last).to_have_text("r1 step 2")
    expect(panel.locator(".log-line", has_text="r0")).to_have_count(0)
    with page.expect_download() as download:
        panel.locator("[data-log-download]").click()
    assert download.value.suggested_filename == f"group-{rows['group']}-rank-1.log"
    with open(download.value.path(), encoding="utf-8") as saved:
        assert saved.read() == "r1 init\nr1 step 1\nr1 oops\nr1 step 2\n"

    # every rank again; the group ends when both have
    panel.locator("[data-log-rank]").select_option("")
    expect(lines).to_have_count(7)
    expect(lines.first).to_have_text("[rank 0] r0 init")
    with page.expect_download() as download:
        panel.locator("[data-log-download]").click()
    with open(download.value.path(), encoding="utf-8") as saved:
        downloaded = saved.read().splitlines()
    assert sorted(downloaded) == sorted(
        [f"[rank 0] {text}" for text in agent.sent[first]] + [f"[rank 1] {text}" for text in agent.sent[second]]
    )
    end(first)
    agent.ship(second, ["r1 last words"])
    expect(lines.last).to_have_text("[rank 1] r1 last words")
    expect(panel).to_have_attribute("data-state", "live")
    end(second)
    expect(panel.locator("[data-log-status]")).to_have_text("Ended: completed (exit codes rank 0: 0, rank 1: 0)")
    expect(page.locator("[data-group-status]")).to_have_text("completed")
    shot(page, "group-ended")
    assert member.violations == []


def test_the_follow_goes_on_through_a_restart_of_the_control_plane(member, live):
    page, agent, flood = member.page, live["agent"], live["rows"]["flood"]
    panel = page.locator("[data-log-panel]")
    page.goto(f"/portal/tasks/{flood}/")
    expect(panel).to_have_attribute("data-state", "live")
    agent.ship(flood, ["before the restart"])
    expect(panel.locator(".log-line").last).to_have_text("before the restart")
    port = int(live["url"].rsplit(":", 1)[1])
    stop_process(live["servers"][-1])
    expect(panel).to_have_attribute("data-state", "reconnecting")
    expect(panel.locator("[data-log-status]")).to_have_text("Reconnecting…")
    live["servers"].append(start_control_plane(port, env=SERVER_ENV)[0])
    agent.ship(flood, ["after the restart 1", "after the restart 2"])
    expect(panel).to_have_attribute("data-state", "live", timeout=20_000)
    expect(panel.locator(".log-line").last).to_have_text("after the restart 2")
    texts = panel.locator(".log-line").all_inner_texts()
    assert texts[-3:] == ["before the restart", "after the restart 1", "after the restart 2"]
    assert len(texts) == len(set(texts)) == 1003  # the first tail and three lines, none twice
    assert member.violations == []


def test_a_task_that_ends_with_no_line_stored_shows_its_final_tail(member, live):
    page, quiet = member.page, live["rows"]["quiet"]
    panel = page.locator("[data-log-panel]")
    page.goto(f"/portal/tasks/{quiet}/")
    expect(panel).to_have_attribute("data-state", "live")
    expect(panel.locator("[data-log-view]")).to_be_hidden()
    assert committed(move_tasks, quiet, ["running"], "failed", exit_code=2, log_tail="fatal: no data\n") == [quiet]
    expect(panel.locator("[data-log-status]")).to_have_text("Ended: failed, exit code 2")
    expect(panel.locator("[data-log-tail] pre")).to_have_text("fatal: no data\n")
    with page.expect_download() as download:
        panel.locator("[data-log-download]").click()
    with open(download.value.path(), encoding="utf-8") as saved:
        assert saved.read() == "fatal: no data\n"
    expect(panel.locator("[data-log-info]")).to_have_text("Downloaded the final tail.")
    assert member.violations == []


def test_a_task_page_draws_the_readings_of_the_cards_it_holds(member, live):
    page, task = member.page, live["rows"]["carded"]
    for power in (200.0, 250.0, 300.0):  # beats a second apart: card 1 is the task's, card 0 is not
        stats = [gpu_stat(0, power_w=90.0), gpu_stat(1, power_w=power, utilization=80.0)]
        beat(live["url"], NODE, heartbeat(gpus=2, hostname=NODE, internal_ip="10.0.0.41", gpu_stats=stats))
        time.sleep(1)
    page.goto(f"/portal/tasks/{task}/")
    cards = page.locator("[data-task-cards]")
    for field in ("utilization", "memory_used_mb", "power_w"):
        chart = cards.locator(f'[data-task-chart="{field}"]')
        expect(chart).to_have_attribute("data-state", "drawn")
        expect(chart).to_have_attribute("data-series", "1")  # its one card, never the other
    expect(cards.locator('[data-task-chart="power_w"] .u-legend')).to_contain_text("GPU 1")
    assert member.violations == []
    shot(page, "task-cards")
