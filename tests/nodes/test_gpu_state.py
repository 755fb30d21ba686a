"""A GPU's state has one rule (apps/nodes/gpu_state.py): the SQL the API's presenter and
/metrics use and the Python the portal, the admin and `Gpu.state` use agree on every
case, every surface shows the same state for the same card, and a list of cards costs
no query per card."""

import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from apps.core.clock import utcnow
from apps.nodes.gpu_state import gpu_state, state_sql
from apps.nodes.models import Gpu
from tests.factories import make_node, make_task_holding
from tests.headers import bearer

pytestmark = pytest.mark.django_db

# card index -> (lost, held): every case of the rule, in order
CASES = {0: (False, False), 1: (False, True), 2: (True, False), 3: (True, True)}
EXPECTED = ["available", "busy", "lost", "lost"]


@pytest.fixture
def cards(world):
    """Node n1 with one card per case: held cards have a running task in the ledger."""
    node = make_node("n1", gpus=len(CASES))
    for index, (lost, held) in CASES.items():
        if lost:
            Gpu.objects.filter(node=node, index=index).update(lost_at=utcnow(), lost_basis="heartbeat_absent")
        if held:
            make_task_holding(node, world.tenants["acme"], "running", card=index)
    return node


def sql_states(node_id):
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {state_sql('gpus')} FROM gpus WHERE node_id = %s ORDER BY index", [node_id])
        return [state for (state,) in cursor.fetchall()]


def test_the_python_and_the_sql_rule_agree_on_every_case(cards):
    assert [gpu_state(lost=lost, held=held) for lost, held in CASES.values()] == EXPECTED
    assert sql_states("n1") == EXPECTED
    assert [gpu.state for gpu in Gpu.objects.with_state().filter(node=cards).order_by("index")] == EXPECTED
    assert [gpu.state for gpu in Gpu.objects.filter(node=cards).order_by("index")] == EXPECTED  # one card at a time


def test_the_api_the_portal_and_the_admin_show_the_same_state(client, api, world, cards):
    client.force_login(world.operator)
    detail = client.get("/portal/nodes/n1/").content.decode()
    cells = re.findall(r'class="gpu-cell ([a-z]+)" title="GPU (\d+) ', client.get("/portal/nodes/").content.decode())
    inline = client.get("/admin/nodes/node/n1/change/").content.decode()
    changelist = client.get("/admin/nodes/gpu/?o=2").content.decode()  # ordered by index
    shown = {
        "api detail": [
            gpu["state"] for gpu in api.get("/api/v1/nodes/n1", **bearer(world.operator_key)).json()["gpus"]
        ],
        "api list": [
            gpu["state"] for gpu in api.get("/api/v1/nodes", **bearer(world.operator_key)).json()["results"][0]["gpus"]
        ],
        "portal detail": [
            re.search(r'class="badge ([a-z]+)"', row).group(1) for row in detail.split('<tr data-gpu="')[1:]
        ],
        "portal list": [state for state, _ in sorted(cells, key=lambda cell: int(cell[1]))],
        # the admin says "LOST since … (basis)" for a lost card: its first word is the state
        "admin node": [text.split()[0].lower() for text in re.findall(r'field-state_shown">\s*<p>([^<]+)</p>', inline)],
        "admin gpus": [text.split()[0].lower() for text in re.findall(r'field-state_shown">([^<]+)</td>', changelist)],
    }
    assert shown == dict.fromkeys(shown, EXPECTED)


def queries(client, url) -> int:
    with CaptureQueriesContext(connection) as captured:
        assert client.get(url).status_code == 200
    return len(captured)


@pytest.mark.parametrize(
    "url", ["/portal/nodes/", "/portal/nodes/n1/", "/admin/nodes/node/n1/change/", "/admin/nodes/gpu/"]
)
def test_a_page_of_cards_asks_for_their_state_once_not_per_card(client, world, url):
    client.force_login(world.operator)
    node = make_node("n1", gpus=2)
    make_task_holding(node, world.tenants["acme"], "running", card=0)
    queries(client, url)  # a process's first page fills its caches (content types, permissions)
    few = queries(client, url)
    Gpu.objects.bulk_create(Gpu(node=node, index=i, vendor="nvidia") for i in range(2, 8))
    make_task_holding(node, world.tenants["acme"], "scheduled", card=5)
    assert queries(client, url) == few
