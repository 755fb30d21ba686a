"""The tunnel end to end, with real processes (docs/tunnel.md): two control-plane
instances (each a web process and a tunnel process, on the test database and Redis),
a real agent (the process runtime, a stand-in nvidia-smi with two cards) that dials
instance A's tunnel process, and `hf` (the client's SDK and its command line).

One plane for the module (starting it is most of the time); each test makes its own
tenants and tasks (the database is emptied between tests; the agent's next beat
registers its node again).

- `hf exec TASK -- nvidia-smi -L` prints the task's card only; the exit status is the
  command's; with a terminal, the size asked;
- `hf port-forward` reaches a real HTTP server started inside a process task, also
  through instance B (forwarded to A, which holds the node's tunnel), and the session is
  audited (who, task, port, bytes each way);
- refusals: another tenant's task 404, a viewer 403, a stopped task 409, a forged
  request (a signed relay request for task A naming a port task B listens on) refused
  by the agent and audited;
- a session idle for HETEROFLOW_TUNNEL_IDLE_SECONDS is ended (audited `idle`), and its
  command with it;
- a restart of instance A (web and tunnel process killed): the agent dials again and a
  new exec works within 10 s."""

from __future__ import annotations

import asyncio
import io
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from heteroflow_client import tunnel as hf_tunnel

from agent.tests.slicing_host import Cards
from apps.core.principals import Principal, PrincipalKind
from apps.nodes.models import Node
from apps.scheduler.services import run_cycle, set_plugin_options
from apps.tasks.choices import TERMINAL
from apps.tasks.models import Task
from apps.tenants import services as tenants
from apps.tenants.choices import Role
from apps.tunnel import keys
from apps.tunnel.models import TunnelSession
from heteroflow.launcher import tunnel_command, web_command
from tests.factories import UserFactory
from tests.faults.cluster import ControlPlane
from tests.flush import empty_database
from tests.headers import bearer_http
from tests.live import REPO, free_port, start_agent, stop_process, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
IDLE_SECONDS = 6

SERVE = (
    "import http.server, sys; http.server.ThreadingHTTPServer(('127.0.0.1', int(sys.argv[1])), "
    "http.server.SimpleHTTPRequestHandler).serve_forever()"
)


class Instance(ControlPlane):
    """One control-plane instance (tests/faults/cluster.py's, with the tunnel process in
    place of the Celery processes), in a log folder of its own; `restart()` kills both
    without warning and starts them again on the same ports."""

    def __init__(self, log_dir: Path, name: str):
        (log_dir / name).mkdir()
        self.relay_port, self.tunnel_port = free_port(), free_port()
        super().__init__(
            log_dir / name,
            HETEROFLOW_TUNNEL_PORT=str(self.tunnel_port),
            HETEROFLOW_TUNNEL_RELAY_PORT=str(self.relay_port),
            HETEROFLOW_TUNNEL_PUBLIC_HOST="127.0.0.1",
            HETEROFLOW_TUNNEL_IDLE_SECONDS=str(IDLE_SECONDS),  # the tests' sessions never wait this long but one
        )
        # apps are served on a host of their own: `localhost` is another host than the
        # portal's 127.0.0.1 for the browser's cookies
        self.env["HETEROFLOW_APP_HOST"] = f"localhost:{self.port}"

    def commands(self) -> dict[str, list[str]]:
        return {"web": web_command("127.0.0.1", self.port, "--log-level", "warning"), "tunnel": tunnel_command()}

    def start(self) -> Instance:
        super().start()
        wait_until(lambda: _listening(self.relay_port), 30, "the tunnel process")
        return self


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def plane(django_db_setup, django_db_blocker, tmp_path_factory):
    logs = tmp_path_factory.mktemp("tunnel")
    with django_db_blocker.unblock():
        a = Instance(logs, "a").start()
        b = Instance(logs, "b").start()
        cards = Cards(logs)
        cards.nvidia(count=2, mig=False)
        agent = start_agent(
            a.url,
            logs / "agent",
            PATH=f"{cards.root / 'usr/bin'}{os.pathsep}{os.environ.get('PATH', '')}",
            HETEROFLOW_RECONCILE_SECONDS="5",
        )
    try:
        yield {"a": a, "b": b, "agent": agent, "logs": logs}
    finally:
        stop_process(agent)
        a.stop()
        b.stop()
        with django_db_blocker.unblock():
            empty_database()  # what the agent wrote after the last test's flush


def explain(plane) -> str:
    return (
        "\n".join(
            f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}"
            for path in sorted(plane["logs"].glob("*.log"))
        )
        + f"\n--- agent\n{plane['agent'].log_path.read_text(errors='replace')[-4000:]}"
    )


@pytest.fixture
def people(plane):
    """Tenant lab (alice a member, vera a viewer) and tenant other (olga a member), each
    with a key; the node online and its tunnel up."""
    set_plugin_options("resource-filter", extra={"cpu_percent_max": 100, "memory_percent_max": 100})
    found = {}
    for slug, name, role in (
        ("lab", "alice", Role.MEMBER),
        ("lab", "vera", Role.VIEWER),
        ("other", "olga", Role.MEMBER),
    ):
        tenant = tenants.create_tenant(name=slug.title(), slug=slug) if slug not in found else found[slug]
        found[slug] = tenant
        user = UserFactory(username=name)
        tenants.add_member(tenant, username=name, role=role)
        owner = Principal(PrincipalKind.TENANT_USER, user=user, tenant=tenant, role=role)
        found[name] = tenants.issue_tenant_key(principal=owner, tenant=tenant, owner=user, name="laptop").key
    wait_until(lambda: Node.objects.filter(status="online").exists(), 60, "the node to come online")
    return found


def submit(url: str, key: str, command: list[str], gpus: int = 0) -> int:
    answer = requests.post(
        f"{url}/api/v1/tasks",
        json={"name": "t", "image": "busybox", "command": command, "gpu_required": gpus},
        headers=bearer_http(key),
        timeout=30,
    )
    assert answer.status_code == 201, answer.text
    return answer.json()["id"]


def running(task_id: int, plane) -> Task:
    wait_until(lambda: task_id in run_cycle().bound, 30, f"task {task_id} to be placed")
    return wait_until(
        lambda: (task := Task.objects.get(pk=task_id)).status == "running" and task, 60, f"task {task_id} to run"
    )


def started(task_id: int, key: str, plane) -> None:
    """Running on the server is claimed; the agent starts the process a moment later:
    until then the node refuses (it does not run it yet)."""
    running(task_id, plane)
    wait_until(lambda: hf(plane, key, "exec", str(task_id), "--", "true").returncode == 0, 30, "the task's start")


def serving(url: str, key: str, plane) -> tuple[int, int]:
    port = free_port()
    task_id = submit(url, key, [sys.executable, "-c", SERVE, str(port)])
    running(task_id, plane)
    wait_until(lambda: _listening(port), 30, "the task's HTTP server")
    return task_id, port


def submit_notebook(plane, key: str) -> int:
    """An interactive Jupyter task on a card, under the process runtime (the agent's
    engine Python has jupyter_server)."""
    answer = requests.post(
        f"{plane['a'].url}/api/v1/tasks",
        json={"name": "nb", "kind": "interactive", "app": "jupyter", "runtime": "process", "gpu_required": 1},
        headers=bearer_http(key),
        timeout=30,
    )
    assert answer.status_code == 201, answer.text
    return answer.json()["id"]


def stop_and_wait(plane, key: str, task_id: int) -> None:
    """Stop the task and wait until the agent has ended it: a process it leaves behind
    (the module's agent stops first) would hold the task's port for the next tests."""
    requests.post(f"{plane['a'].url}/api/v1/tasks/{task_id}/stop", headers=bearer_http(key), timeout=30)
    wait_until(lambda: Task.objects.get(pk=task_id).status in TERMINAL, 60, f"task {task_id} to end")


def hf(plane, key: str, *args: str, url: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETEROFLOW_")}
    env |= {"HETEROFLOW_URL": url or plane["a"].url, "HETEROFLOW_API_KEY": key, "HOME": str(plane["logs"])}
    return subprocess.run(
        [sys.executable, "-m", "heteroflow_client.cli", *args],
        env=env,
        cwd=REPO / "client",
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


async def fetch_through(url: str, key: str, task_id: int, port: int) -> bytes:
    """GET / through a port-forward (the SDK's) to the task's port."""
    ready = asyncio.get_running_loop().create_future()
    forward = asyncio.ensure_future(hf_tunnel.serve_port_forward(url, key, task_id, 0, port, on_ready=ready.set_result))
    try:
        local = await asyncio.wait_for(ready, 30)
        reader, writer = await asyncio.open_connection("127.0.0.1", local)
        writer.write(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 30)
        writer.close()
        return data
    finally:
        forward.cancel()
        await asyncio.gather(forward, return_exceptions=True)


def test_exec_prints_the_tasks_cards_only_and_exits_with_the_commands_status(plane, people):
    task_id = submit(plane["a"].url, people["alice"], ["sleep", "300"], gpus=1)
    started(task_id, people["alice"], plane)
    done = hf(plane, people["alice"], "exec", str(task_id), "--", "nvidia-smi", "-L")
    assert done.returncode == 0, done.stderr + explain(plane)
    cards = [line for line in done.stdout.splitlines() if line.startswith("GPU ")]
    visible = hf(plane, people["alice"], "exec", str(task_id), "--", "sh", "-c", "echo $NVIDIA_VISIBLE_DEVICES")
    assert len(cards) == 1 and cards[0].startswith(f"GPU {visible.stdout.strip()}:"), done.stdout
    assert hf(plane, people["alice"], "exec", str(task_id), "--", "sh", "-c", "exit 3").returncode == 3

    out = io.BytesIO()
    status = asyncio.run(
        hf_tunnel.run_exec(
            plane["a"].url, people["alice"], task_id, ["stty", "size"], tty=True, stdin=io.BytesIO(b""), stdout=out
        )
    )
    assert (status, out.getvalue().strip()) == (0, b"24 80")  # no terminal here: hf asks for 80x24
    session = TunnelSession.objects.filter(task_id=task_id, command="nvidia-smi -L").get()
    assert session.principal.startswith("alice (member of lab") and session.outcome == "closed"
    assert session.bytes_out > 0 and session.node_id == Task.objects.get(pk=task_id).node_id


def test_port_forward_reaches_a_server_in_the_task_through_either_instance(plane, people):
    task_id, port = serving(plane["a"].url, people["alice"], plane)
    for url in (plane["a"].url, plane["b"].url):  # b holds no tunnel: it forwards to a
        answer = asyncio.run(fetch_through(url, people["alice"], task_id, port))
        assert answer.startswith(b"HTTP/1.0 200"), answer[:200]
    wait_until(
        lambda: not TunnelSession.objects.filter(task_id=task_id, outcome="open").exists(), 10, "the sessions' ends"
    )  # written by the tunnel process once both sides have closed
    sessions = list(TunnelSession.objects.filter(task_id=task_id).order_by("started_at"))
    assert [s.port for s in sessions] == [port] * 4  # a check, then a GET, through each instance
    last = sessions[-1]
    assert last.outcome == "closed" and last.bytes_in > 20 and last.bytes_out > 100
    assert last.instance == f"127.0.0.1:{plane['a'].relay_port}" and last.ended_at >= last.started_at


def test_who_may_enter_and_a_forged_request_the_agent_refuses(plane, people):
    a = plane["a"].url
    task_id, port = serving(a, people["alice"], plane)
    other_id, other_port = serving(a, people["olga"], plane)

    def refused(key, task, **query):
        with pytest.raises(hf_tunnel.ApiError) as caught:
            asyncio.run(hf_tunnel.serve_port_forward(a, key, task, 0, query.get("port", port)))
        return caught.value.status, caught.value.code

    assert refused(people["olga"], task_id) == (404, "not_found")  # another tenant's
    assert refused(people["vera"], task_id) == (403, "permission_denied")  # a viewer
    assert refused(people["alice"], task_id, port=other_port) == (403, "refused_by_node")  # not its port

    # forged: a correctly signed relay request for alice's task naming olga's port
    with socket.create_connection(("127.0.0.1", plane["a"].relay_port), timeout=10) as relay:
        header = {"kind": "port", "port": other_port, "node": Task.objects.get(pk=task_id).node_id, "task": task_id}
        relay.sendall(keys.sign(header | {"who": {"principal": "forger"}}))
        answer = relay.makefile("rb").readline()
    assert b'"ok":false' in answer and b"does not listen on port" in answer
    forged = TunnelSession.objects.get(principal="forger")
    assert forged.outcome == "refused" and f"does not listen on port {other_port}" in forged.reason

    Task.objects.filter(pk=other_id).update(status="stopped")  # as the API's stop ends it
    assert refused(people["olga"], other_id, port=other_port) == (409, "task_not_running")


def test_an_idle_session_is_ended_and_its_command_with_it(plane, people):
    task_id = submit(plane["a"].url, people["alice"], ["sleep", "300"])
    started(task_id, people["alice"], plane)
    begun = time.monotonic()
    done = hf(plane, people["alice"], "exec", str(task_id), "--", "sh", "-c", "sleep 60")
    assert IDLE_SECONDS <= time.monotonic() - begun < IDLE_SECONDS + 8
    assert done.returncode == 255 and f"session ended: no traffic for {IDLE_SECONDS} s" in done.stderr
    session = wait_until(
        lambda: TunnelSession.objects.filter(task_id=task_id, command="sh -c sleep 60").exclude(outcome="open").first(),
        10,
        "the session's end",
    )
    assert session.outcome == "idle" and session.ended_at is not None
    still = hf(plane, people["alice"], "exec", str(task_id), "--", "sh", "-c", "pgrep -f 'sleep [6]0' || true")
    assert still.stdout.strip() == ""  # its command ended with it


def test_hf_open_reaches_a_real_jupyter_server_and_its_kernel_runs_code(plane, people):
    """An interactive task: the agent starts a real jupyter_server bound to localhost in
    the task (the process runtime, under its engine Python); `hf open` forwards a local
    port to it through the tunnel and prints its URL with the token; through it a kernel
    is started over Jupyter's REST API and runs `1+1` over its WebSocket."""
    import json
    import uuid

    from websockets.sync.client import connect

    task_id = submit_notebook(plane, people["alice"])
    running(task_id, plane)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETEROFLOW_")}
    env |= {"HETEROFLOW_URL": plane["a"].url, "HETEROFLOW_API_KEY": people["alice"], "HOME": str(plane["logs"])}
    opened = subprocess.Popen(
        [sys.executable, "-m", "heteroflow_client.cli", "open", str(task_id)],
        env=env,
        cwd=REPO / "client",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = opened.stdout.readline().strip()  # once jupyter listens and the forward is up
        assert url.startswith("http://127.0.0.1:") and "?token=" in url, url + opened.stderr.read() + explain(plane)
        base, token = url.split("/?token=")
        auth = {"Authorization": f"token {token}"}
        assert requests.get(f"{base}/api/status", headers=auth, timeout=30).status_code == 200
        assert requests.get(f"{base}/api/status", timeout=30).status_code == 403  # the token is asked for
        kernel = requests.post(f"{base}/api/kernels", json={"name": "python3"}, headers=auth, timeout=60)
        assert kernel.status_code == 201, kernel.text
        channels = f"{base.replace('http', 'ws', 1)}/api/kernels/{kernel.json()['id']}/channels?token={token}"
        msg_id, session = uuid.uuid4().hex, uuid.uuid4().hex
        request = {
            "header": {"msg_id": msg_id, "session": session, "username": "alice", "msg_type": "execute_request",
                       "version": "5.3"},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": "1+1", "silent": False, "store_history": False, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": True},
        }  # fmt: skip
        with connect(channels, open_timeout=30) as ws:
            ws.send(json.dumps(request))
            deadline = time.monotonic() + 60
            result = None
            while result is None and time.monotonic() < deadline:
                message = json.loads(ws.recv(timeout=60))
                if message["msg_type"] == "execute_result" and message["parent_header"].get("msg_id") == msg_id:
                    result = message["content"]["data"]["text/plain"]
        assert result == "2"
    finally:
        opened.terminate()
        opened.wait(10)
        stop_and_wait(plane, people["alice"], task_id)
    sessions = TunnelSession.objects.filter(task_id=task_id, port=Task.objects.get(pk=task_id).host_port)
    assert sessions.exists()  # every connection through hf open is audited


def test_hf_run_app_shell_starts_a_task_that_waits_to_be_entered(plane, people):
    """`hf run --app shell`: an interactive task whose process only waits, entered with
    `hf exec` (as `hf open` and the terminal do), running until it is stopped."""
    flags = ["--app", "shell", "--gpus", "0", "--image", "busybox", "--idle-minutes", "5"]
    made = hf(plane, people["alice"], "run", *flags)
    assert made.returncode == 0, made.stderr
    task_id = int(made.stdout.strip())
    shown = Task.objects.get(pk=task_id)
    assert (shown.kind, shown.app, shown.idle_minutes, shown.name) == ("interactive", "shell", 5, "shell")
    started(task_id, people["alice"], plane)
    entered = hf(plane, people["alice"], "exec", str(task_id), "--", "sh", "-c", "echo in-$((40+2))")
    assert entered.returncode == 0 and entered.stdout.strip() == "in-42", entered.stderr
    time.sleep(2)
    assert Task.objects.get(pk=task_id).status == "running"  # the app waits; nothing ends it
    stopped = hf(plane, people["alice"], "stop", str(task_id))
    assert stopped.returncode == 0, stopped.stderr
    wait_until(lambda: Task.objects.get(pk=task_id).status == "stopped", 60, "the shell task to stop")


KERNEL_RUNS_1_PLUS_1 = """
async () => {
  const base = location.pathname;
  const status = (await fetch(base + "api/status")).status;
  const made = await fetch(base + "api/kernels", {method: "POST", headers: {"Content-Type": "application/json"},
                                                  body: JSON.stringify({name: "python3"})});
  const kernel = await made.json();
  const ws = new WebSocket(`ws://${location.host}${base}api/kernels/${kernel.id}/channels`);
  const msgId = "m" + Math.random().toString(16).slice(2);
  const result = await new Promise((resolve, reject) => {
    ws.onopen = () => ws.send(JSON.stringify({
      header: {msg_id: msgId, session: "s" + msgId, username: "alice", msg_type: "execute_request", version: "5.3"},
      parent_header: {}, metadata: {}, channel: "shell", buffers: [],
      content: {code: "1+1", silent: false, store_history: false, user_expressions: {}, allow_stdin: false,
                stop_on_error: true}}));
    ws.onmessage = (event) => {
      const message = JSON.parse(event.data);
      if (message.msg_type === "execute_result" && message.parent_header.msg_id === msgId)
        resolve(message.content.data["text/plain"]);
    };
    ws.onerror = () => reject(new Error("the kernel's WebSocket failed"));
    setTimeout(() => reject(new Error("no answer in 60 s")), 60000);
  });
  ws.close();
  return [status, made.status, result];
}
"""


@pytest.mark.browser
def test_the_portal_opens_a_notebook_whose_kernel_runs_code_and_a_viewer_is_refused(plane, people, monkeypatch):
    """In Chromium: alice's *Open* on an interactive task's page goes to its app through
    the control plane's proxy (a one-use ticket, then a cookie for that app's path only),
    and the page's script starts a kernel and runs `1+1` over Jupyter's REST API and its
    WebSocket; vera (a viewer) and a visitor without the cookie are refused."""
    from heteroflow_client.client import Client

    from tests.portal.browser.support import CHROMIUM, CHROMIUM_ARGS, PASSWORD, SCREENSHOTS, Browser, sync_api

    task_id = submit_notebook(plane, people["alice"])
    task = running(task_id, plane)
    with Client(plane["a"].url, people["alice"]) as client:
        hf_tunnel.wait_for_port(client, task_id, task.host_port, 120)
    for name in ("alice", "vera"):
        user = UserFactory(username=name)
        user.set_password(PASSWORD)
        user.save(update_fields=["password"])
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    try:
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            live = {"url": plane["a"].url, "browser": browser}
            try:
                alice = Browser(live, "alice")
                alice.page.goto(f"/portal/tasks/{task_id}/")
                with alice.context.expect_page() as opened:
                    alice.page.click("[data-open-link]")
                app = opened.value
                app.wait_for_load_state()
                port = plane["a"].port
                assert app.url == f"http://localhost:{port}/apps/{task_id}/", app.url  # its host; the ticket gone
                assert app.evaluate(KERNEL_RUNS_1_PLUS_1) == [200, 201, "2"]
                app.screenshot(path=str(SCREENSHOTS / "notebook-open.png"))
                again = app.request.get(f"http://localhost:{port}/apps/{task_id}/?hf_ticket=used-or-forged")
                assert again.status == 401  # a ticket is checked whenever one is given
                assert alice.page.request.get(f"/apps/{task_id}/api/status").status == 404  # not on the portal's host
                alice.close()

                vera = Browser(live, "vera")
                vera.page.goto(f"/portal/tasks/{task_id}/open/")
                sync_api.expect(vera.page.locator(".messages, .message, [role=alert]").first).to_contain_text(
                    "Only the tenant's members and admins may enter a task."
                )
                vera.close()
            finally:
                browser.close()
        without_cookie = requests.get(f"http://localhost:{plane['a'].port}/apps/{task_id}/api/status", timeout=30)
        assert without_cookie.status_code == 403 and "Open the app from its task's page" in without_cookie.text
        sessions = TunnelSession.objects.filter(task_id=task_id, port=task.host_port)
        assert sessions.filter(principal="alice (member of lab, in the portal)").count() >= 3  # a session a request
    finally:
        stop_and_wait(plane, people["alice"], task_id)


@pytest.mark.browser
def test_the_portal_terminal_is_a_shell_in_the_task_for_a_member_and_refused_to_a_viewer(plane, people, monkeypatch):
    """In Chromium: alice (a member) opens the terminal from the task's page and gets a
    shell in the task at the size of her screen; leaving it ends it, audited as the
    portal's; vera (a viewer) is refused on the page; no CSP violation on either."""
    from tests.portal.browser.support import PASSWORD, SCREENSHOTS, Browser, sync_api

    task_id = submit(plane["a"].url, people["alice"], ["sleep", "300"])
    started(task_id, people["alice"], plane)
    for name in ("alice", "vera"):
        user = UserFactory(username=name)
        user.set_password(PASSWORD)
        user.save(update_fields=["password"])
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # the ORM between browser steps
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as playwright:
        from tests.portal.browser.support import CHROMIUM, CHROMIUM_ARGS

        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        live = {"url": plane["a"].url, "browser": browser}
        try:
            alice = Browser(live, "alice")
            page = alice.page
            page.goto(f"/portal/tasks/{task_id}/")
            page.click("[data-terminal-link]")
            status = page.locator("#terminal-status")
            sync_api.expect(status).to_have_text("Connected", timeout=30_000)
            sync_api.expect(page.locator("#terminal-again")).to_be_hidden()
            rows = page.locator("#terminal .xterm-rows")
            page.keyboard.type("echo hello-$((6*7)); stty size\n")
            sync_api.expect(rows).to_contain_text("hello-42", timeout=15_000)
            # stty's answer is the next row, which may be drawn a moment after the echo's
            size_rows = (
                "() => [...document.querySelectorAll('#terminal .xterm-rows > div')].map(r => r.textContent.trim())"
                ".filter(t => /^\\d+ \\d+$/.test(t))"
            )
            page.wait_for_function(f"({size_rows})().length > 0", timeout=15_000)
            size = page.evaluate(size_rows)
            assert size, rows.text_content()
            rows_, cols = map(int, size[-1].split())
            assert cols > 80 and rows_ > 10, size  # the browser's size, not a default 80x24
            page.screenshot(path=str(SCREENSHOTS / "terminal.png"))
            page.keyboard.type("exit\n")
            sync_api.expect(status).to_have_text("The shell ended (exit status 0).", timeout=15_000)
            sync_api.expect(page.locator("#terminal-again")).to_be_visible()
            assert alice.violations == []
            alice.close()

            vera = Browser(live, "vera")
            vera.page.goto(f"/portal/tasks/{task_id}/")
            assert vera.page.locator("[data-terminal-link]").count() == 0
            vera.page.goto(f"/portal/tasks/{task_id}/terminal/")
            sync_api.expect(vera.page.locator("[data-terminal-refused]")).to_have_text(
                "Only the tenant's members and admins may enter a task."
            )
            answer = vera.page.request.post(f"/portal/tasks/{task_id}/terminal/ticket/")
            assert answer.status == 403  # no CSRF token: refused before anything else
            assert vera.violations == []
            vera.close()
        finally:
            browser.close()
    session = wait_until(
        lambda: (
            TunnelSession.objects.filter(task_id=task_id, principal__contains="in the portal")
            .exclude(outcome="open")
            .first()
        ),
        15,
        "the terminal's session audited",
    )
    assert session.principal == "alice (member of lab, in the portal)" and session.outcome == "closed"
    assert session.bytes_in > 0 and session.bytes_out > 0


def test_the_tunnel_survives_a_restart_of_the_control_plane(plane, people):
    task_id = submit(plane["a"].url, people["alice"], ["sleep", "300"])
    started(task_id, people["alice"], plane)
    plane["a"].restart()

    restarted = time.monotonic()
    done = wait_until(
        lambda: (d := hf(plane, people["alice"], "exec", str(task_id), "--", "echo", "back")).returncode == 0 and d,
        20,
        "an exec after the restart",
    )
    assert done.stdout == "back\n" and time.monotonic() - restarted < 10, explain(plane)
