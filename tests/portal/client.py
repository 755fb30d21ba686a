"""The Django test client as the page tests use it: a signed-in user, a page read with
the status it must answer."""

from __future__ import annotations


def page(client, url, status=200):
    response = client.get(url)
    assert response.status_code == status, (url, response.status_code)
    return response.content.decode()


def signed_in(client, user):
    client.force_login(user)
    return client
