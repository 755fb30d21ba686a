from django.db import models


class SessionKind(models.TextChoices):
    PORT = "port"  # a direct-tcpip channel to a port of the task (hf port-forward)
    EXEC = "exec"  # a command in the task (hf exec, hf ssh)


class SessionOutcome(models.TextChoices):
    OPEN = "open"  # still going (or its tunnel process died before it could say)
    CLOSED = "closed"  # either end closed it
    REFUSED = "refused"  # the node refused it (reason: the agent's words)
    IDLE = "idle"  # no byte either way for HETEROFLOW_TUNNEL_IDLE_SECONDS
    MAX_LENGTH = "max_length"  # open for HETEROFLOW_TUNNEL_MAX_SECONDS
    LOST = "lost"  # the node's tunnel went away under it
    UNREACHABLE = "unreachable"  # no tunnel to the node on any instance


ENDED = (SessionOutcome.CLOSED, SessionOutcome.IDLE, SessionOutcome.MAX_LENGTH, SessionOutcome.LOST)
