"""The environment page's image part in a real browser (Chromium driven by Playwright
against the control plane under uvicorn, as tests/portal/browser/test_walkthrough.py
does; docs/images.md). An operator opens the page: its script checks the watched images
of the live node on the page; the test answers as the node's agent over HTTP (claim,
result) and the page shows "n/m present" and the versions. Deploy starts a pull that the
page follows every 5 s (its progress as the agent reports it), and checks the node again
once it is deployed. The offline node is "cannot check" and gets no request.

The data the server must see is committed once for the module and removed at the end;
the default watched images are put back (the clean-up flushes the tables)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import requests

from apps.core.clock import utcnow
from apps.nodes.models import ImageRequest, Node
from tests.factories import OperatorFactory
from tests.headers import AGENT_HTTP
from tests.live import wait_until
from tests.nodes.image_support import DIGEST, claim, completed, item, progress, seed_default_watched_images
from tests.nodes.payloads import heartbeat
from tests.portal.browser.support import (  # skips this module without a browser
    PASSWORD,
    SCREENSHOTS,
    WAIT_MS,
    beat,
    committed,
    live_portal,
    sync_api,
)

pytestmark = [pytest.mark.browser, pytest.mark.django_db]
expect = sync_api.expect
NODE, OFFLINE, SILENT = "gpu-img-01", "gpu-img-off", "gpu-img-old"
FOLLOW_MS = 5_000 + WAIT_MS  # the page asks every 5 s; an expectation then waits its own time


def add_offline_node():
    Node.objects.create(
        id=OFFLINE, name=OFFLINE, status="offline", gpu_type="nvidia", last_heartbeat_at=utcnow() - timedelta(hours=1)
    )


def seed(url: str) -> None:
    committed(seed_default_watched_images)
    committed(OperatorFactory, username="img-ops", password=PASSWORD)
    beat(url, NODE, heartbeat(gpus=2, hostname=NODE))
    committed(add_offline_node)


@pytest.fixture(scope="module")
def live(django_db_setup, django_db_blocker):
    with django_db_blocker.unblock(), live_portal(seed) as world:
        yield world


@pytest.fixture(scope="module")
def page(live):
    context = live["browser"].new_context(viewport={"width": 1500, "height": 900}, base_url=live["url"])
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    page.goto("/portal/login/")
    page.fill("#id_username", "img-ops")
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    expect(page.locator("#status-bar")).to_be_visible()
    yield page
    context.close()


class Agent:
    """The node's agent, by hand, over HTTP: what its image poller would send."""

    def __init__(self, url: str):
        self.url = url

    def pending(self) -> list[dict]:
        answer = requests.get(
            f"{self.url}/api/v1/agent/image-requests",
            params={"node_id": NODE, "status": "pending"},
            headers=AGENT_HTTP,
            timeout=10,
        )
        assert answer.status_code == 200, answer.text
        return answer.json()["results"]

    def next_request(self, action: str) -> dict:
        return wait_until(
            lambda: next((r for r in self.pending() if r["action"] == action), None), 15, f"a {action} request"
        )

    def put(self, request_id: int, body: dict) -> dict:
        answer = requests.put(
            f"{self.url}/api/v1/agent/image-requests/{request_id}", json=body, headers=AGENT_HTTP, timeout=10
        )
        assert answer.status_code == 200, answer.text
        return answer.json()


def answer_check(agent: Agent, present: set[str]) -> dict:
    row = agent.next_request("check")
    agent.put(row["id"], claim(NODE))
    items = []
    for reference in row["references"]:
        if ":" in reference.rsplit("/", 1)[-1]:
            items.append(item(reference, present=reference in present))
        else:  # a bare repository: every local tag
            tags = [
                {"tag": f"{reference}:v0.8.5", "image_id": DIGEST, "size_bytes": 9 * 1024**3},
                {"tag": f"{reference}:v0.9.0", "image_id": "sha256:" + "cd" * 32, "size_bytes": 10 * 1024**3},
            ]
            shown = reference in present
            items.append(item(reference, present=shown, match="repository", tags=tags if shown else []))
    return agent.put(row["id"], completed(NODE, *items))


def test_the_operator_checks_and_deploys_the_watched_images(live, page):
    agent = Agent(live["url"])
    beat(live["url"], NODE, heartbeat(gpus=2, hostname=NODE))  # online for the next 30 s at least
    page.goto("/portal/environment/?tab=all")
    cell = page.locator(f'td[data-images="{NODE}"]')
    offline = page.locator(f'td[data-images="{OFFLINE}"]')
    expect(offline).to_have_attribute("data-state", "cannot-check")
    expect(offline).to_contain_text("cannot check")

    done = answer_check(agent, present={"vllm/vllm-openai"})
    total = len(done["references"])
    expect(cell.locator("[data-images-summary]")).to_have_text(f"1/{total} present", timeout=FOLLOW_MS)
    cell.locator("summary").click()
    vllm = cell.locator('tr[data-image="vllm/vllm-openai"]')
    expect(vllm.locator("[data-image-state]")).to_contain_text("v0.8.5 (9.0 GiB), v0.9.0 (10.0 GiB)")
    expect(cell.locator('tr[data-image="lmsysorg/sglang"] [data-image-state]')).to_have_text("absent")
    page.screenshot(path=str(SCREENSHOTS / "environment-images.png"), full_page=True)

    # deploy an absent image: a pull, followed every 5 s
    sglang = cell.locator('tr[data-image="lmsysorg/sglang"]')
    sglang.locator("button[data-deploy]").click()
    pull = agent.next_request("pull")
    assert pull["references"] == ["lmsysorg/sglang"]
    agent.put(pull["id"], claim(NODE))
    agent.put(pull["id"], progress(NODE, 2, 4, "Downloading"))
    shown = sglang.locator("[data-deploy-progress]")
    expect(shown).to_contain_text("2/4 layers", timeout=FOLLOW_MS)
    expect(shown).to_contain_text("Downloading")
    # an old agent's answer to the bare reference: ":latest", accepted
    agent.put(pull["id"], completed(NODE, item("lmsysorg/sglang:latest")))
    expect(shown).to_have_text("deployed", timeout=FOLLOW_MS)
    # deployed: the node is checked again
    answer_check(agent, present={"vllm/vllm-openai", "lmsysorg/sglang"})
    expect(cell.locator("[data-images-summary]")).to_have_text(f"2/{total} present", timeout=FOLLOW_MS)
    page.screenshot(path=str(SCREENSHOTS / "environment-images-deployed.png"), full_page=True)

    # the offline node was never asked
    asked = committed(lambda: list(ImageRequest.objects.filter(node_id=OFFLINE)))
    assert asked == []


def test_a_check_the_nodes_agent_never_takes_is_given_up(live, page):
    """An agent from before the image channel never claims: the page stops following
    the check (here after 2 s instead of 2 minutes) and says so."""
    beat(live["url"], SILENT, heartbeat(gpus=1, hostname=SILENT))

    def quick(route):
        answer = route.fetch()
        route.fulfill(response=answer, body=answer.text().replace('"check_wait_ms": 120000', '"check_wait_ms": 2000'))

    page.route("**/portal/environment/*", quick)
    try:
        page.goto("/portal/environment/?tab=alive")
        cell = page.locator(f'td[data-images="{SILENT}"]')
        expect(cell).to_have_attribute("data-state", "no-answer", timeout=FOLLOW_MS)
        expect(cell.locator("[data-images-summary]")).to_contain_text("no answer from the node's agent")
    finally:
        page.unroute("**/portal/environment/*")
