"""Authentication backends of the sign-in form and of the directory (docs/identity.md)."""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.backends import ModelBackend


def is_break_glass(user) -> bool:
    """A local operator account: staff, and never signed in through a directory. It keeps
    its password when HETEROFLOW_LOCAL_SIGN_IN is off, so that the platform can be reached
    while the directory cannot."""
    return bool(user.is_staff) and not user.directory_identities.exists()


class LocalPasswordBackend(ModelBackend):
    """Django's password check, for everyone while HETEROFLOW_LOCAL_SIGN_IN is on, and for
    break-glass operators only while it is off."""

    def user_can_authenticate(self, user):
        if not super().user_can_authenticate(user):
            return False
        return settings.HETEROFLOW_LOCAL_SIGN_IN or is_break_glass(user)

    def get_user(self, user_id):
        # a session keeps working whatever the setting says now (it was signed in then):
        # not ModelBackend's, which asks user_can_authenticate
        user = get_user_model()._default_manager.filter(pk=user_id).first()
        return user if user is not None and user.is_active else None


class DirectoryBackend(ModelBackend):
    """The backend a session signed in through OpenID Connect is recorded with: it checks
    no password (apps.identity.oidc did the checking) and only finds the session's user."""

    def authenticate(self, request, **credentials):
        return None
