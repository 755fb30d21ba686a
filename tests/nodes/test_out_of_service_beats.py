"""The agents' beats leave a node's cordon label alone (operators' drain and maintenance:
test_out_of_service.py). Apart from that module because it is transactional (the beat's
own connection must see committed rows), and a module's shared `world` would hold an
open transaction across it."""

import pytest

from apps.nodes.models import Node
from apps.nodes.services import drain_node
from apps.scheduler.core import CORDON_LABEL


@pytest.mark.django_db(transaction=True)
def test_a_heartbeat_leaves_the_cordon_in_place(agents):
    from tests.nodes.payloads import heartbeat

    assert agents.send("n9", heartbeat(gpus=1)).status_code == 200
    drain_node(Node.objects.get(pk="n9"))
    changed = heartbeat(gpus=1, labels={"heteroflow.network_zone": "vpc-2"})  # a structural change: the slow path
    assert agents.send("n9", changed).status_code == 200
    assert agents.send("n9", changed).status_code == 200  # and a steady beat
    labels = Node.objects.get(pk="n9").labels
    assert labels[CORDON_LABEL] == "drain" and labels["heteroflow.network_zone"] == "vpc-2"
