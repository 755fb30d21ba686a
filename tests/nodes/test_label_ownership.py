"""Labels an agent owns: a beat that carries `owned_label_keys` may remove a label the
agent set itself by leaving it out; an operator's label and the cordon label are never
removed by an agent; an agent without `owned_label_keys` (an older release) keeps the
merge by key. Through the real ASGI route and PostgreSQL, hence transactional tests."""

import psycopg
import pytest

from apps.nodes.choices import CORDON_LABEL
from apps.nodes.models import Node
from apps.nodes.services import drain_node, upsert_node
from heteroflow_agent.client import ServerClient
from heteroflow_agent.collect import ContainerEngine, EngineState
from heteroflow_agent.config import AgentConfig
from heteroflow_agent.heartbeat import CACHED_MODELS_LABEL, Heartbeat
from tests.nodes.payloads import heartbeat as payload

pytestmark = pytest.mark.django_db(transaction=True)


class StatementCounter:
    """The first word of each statement the heartbeat route sends (as in test_heartbeat)."""

    def __init__(self, monkeypatch):
        self.statements = []
        original = psycopg.AsyncCursor.execute

        async def counting(cursor, query, params=None, **kwargs):
            self.statements.append(str(query).split()[0].upper())
            return await original(cursor, query, params, **kwargs)

        monkeypatch.setattr(psycopg.AsyncCursor, "execute", counting)


class NoEngine(ContainerEngine):
    def state(self):
        return EngineState(False, "no container engine here")


def owning(labels: dict, **overrides) -> dict:
    """A beat of an agent that owns every label it sends (as this release's agent does)."""
    return payload(labels=labels, owned_label_keys=sorted(labels), **overrides)


def node(node_id="n1") -> Node:
    return Node.objects.get(pk=node_id)


def test_an_owned_label_left_out_is_removed(agents):
    assert agents.send("n1", owning({"pool": "a", "rack": "r7"})).status_code == 200
    assert (node().labels, node().agent_label_keys) == ({"pool": "a", "rack": "r7"}, ["pool", "rack"])
    assert agents.send("n1", owning({"rack": "r8"})).status_code == 200
    assert (node().labels, node().agent_label_keys) == ({"rack": "r8"}, ["rack"])


def test_removal_takes_the_slow_path_once_and_costs_what_any_structural_change_does(agents, monkeypatch):
    agents.send("n1", owning({"pool": "a", "rack": "r7"}))
    agents.send("n2", owning({"pool": "a", "rack": "r7"}))
    counter = StatementCounter(monkeypatch)
    agents.send("n1", owning({"pool": "a", "rack": "r8"}))  # a value changes: a structural change
    changed = list(counter.statements)
    counter.statements.clear()
    agents.send("n2", owning({"rack": "r7"}))  # a label goes
    assert counter.statements == changed and len(changed) > 1  # no statement more than before
    counter.statements.clear()
    agents.send("n2", owning({"rack": "r7"}, cpu_used=12.0))
    assert counter.statements == ["WITH"]  # steady again: one statement
    assert node("n2").labels == {"rack": "r7"}


def test_an_older_agent_keeps_the_merge_by_key(agents, monkeypatch):
    """No `owned_label_keys`: labels merge and none is removed, and its steady beat is one
    statement as before (its structure hash does not change with this server)."""
    assert agents.send("n1", payload(labels={"pool": "a"})).status_code == 200
    assert agents.send("n1", payload(labels={"rack": "r7"})).status_code == 200
    assert (node().labels, node().agent_label_keys) == ({"pool": "a", "rack": "r7"}, [])
    counter = StatementCounter(monkeypatch)
    agents.send("n1", payload(labels={"rack": "r7"}))
    assert counter.statements == ["WITH"]


def test_an_agent_downgraded_removes_nothing_and_an_upgrade_picks_up_its_record(agents):
    agents.send("n1", owning({"pool": "a", "rack": "r7"}))
    agents.send("n1", payload(labels={"rack": "r7"}))  # the previous release: merges
    assert node().labels == {"pool": "a", "rack": "r7"} and node().agent_label_keys == ["pool", "rack"]
    agents.send("n1", owning({"rack": "r7"}, agent_version="2.6.0"))  # upgraded again
    assert node().labels == {"rack": "r7"}


def test_an_operators_label_is_never_removed_by_an_agent(agents):
    agents.send("n1", owning({"rack": "r7", "pool": "a"}))
    upsert_node("n1", {"labels": {"owner": "team-x", "pool": "b"}})  # an operator's, "pool" taken over
    assert node().agent_label_keys == ["rack"]
    # claiming keys it never sent, and leaving out the operator's: neither is removed
    agents.send("n1", payload(labels={"rack": "r7"}, owned_label_keys=["rack", "owner", "pool"]))
    assert node().labels == {"rack": "r7", "owner": "team-x", "pool": "b"}
    assert node().agent_label_keys == ["rack"]


def test_a_key_the_agent_sends_again_is_its_own_again(agents):
    agents.send("n1", owning({"pool": "a"}))
    upsert_node("n1", {"labels": {"pool": "b"}})
    agents.send("n1", owning({"pool": "c"}))  # as today: the agent's value wins, and it owns the key
    assert (node().labels, node().agent_label_keys) == ({"pool": "c"}, ["pool"])
    agents.send("n1", owning({}))
    assert node().labels == {}


def test_an_agent_neither_sets_nor_removes_the_cordon(agents):
    agents.send("n1", owning({"rack": "r7"}))
    drain_node(node())
    sneaky = {"rack": "r7", CORDON_LABEL: ""}  # an empty cordon would put the node back in service
    assert agents.send("n1", owning(sneaky)).status_code == 200
    assert node().labels == {"rack": "r7", CORDON_LABEL: "drain"}
    assert CORDON_LABEL not in node().agent_label_keys
    assert agents.send("n1", payload(labels={}, owned_label_keys=[CORDON_LABEL, "rack"])).status_code == 200
    assert node().labels == {CORDON_LABEL: "drain"}  # its own label goes, the cordon stays


@pytest.mark.parametrize(
    "owned",
    [
        "rack",  # not a list
        ["rack", "rack"],  # twice
        ["bad key!"],  # not a label key
        [f"k{i}" for i in range(65)],  # more than a node has labels
        [7],
    ],
)
def test_owned_label_keys_are_checked_strictly(agents, owned):
    response = agents.send("n1", payload(owned_label_keys=owned))
    assert response.status_code == 400
    assert any(name.startswith("owned_label_keys") for name in response.json()["error"]["fields"])
    assert not Node.objects.filter(pk="n1").exists()


def test_the_real_agent_removes_a_label_taken_out_of_its_configuration(agents, tmp_path):
    """The agent as it runs: a label in its configuration, then a restart with the label
    taken out. The node loses it; the operator's label stays."""

    def agent(labels):
        config = AgentConfig(
            server_url="http://testserver",
            api_key="unused",
            node_id="gpu-09",
            data_dir=tmp_path,
            allow_process_runtime=True,
            model_scan_dirs=(str(tmp_path),),
            labels=labels,
        )
        return Heartbeat(
            config, ServerClient("http://testserver", "unused"), detect_gpus=lambda: NoCards(), engine=NoEngine()
        )

    assert agents.send("gpu-09", agent({"rack": "r7", "pool": "a"}).payload()).status_code == 200
    upsert_node("gpu-09", {"labels": {"owner": "team-x"}})
    assert agents.send("gpu-09", agent({"rack": "r7"}).payload()).status_code == 200
    assert node("gpu-09").labels == {"rack": "r7", "owner": "team-x", CACHED_MODELS_LABEL: ""}


class NoCards:
    gpus: list = []
    collect_failures: list = []
    collector_error = ""
    capabilities: dict = {}
    labels: dict = {}
    is_container = False
    vendor = None
