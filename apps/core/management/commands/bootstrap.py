"""Create the platform administrator (and optionally an operator API key). Idempotent.

Credentials come from HETEROFLOW_ADMIN_USER / HETEROFLOW_ADMIN_PASSWORD; when no password
is given, one is generated, printed once and stored in HETEROFLOW_DATA_DIR with mode 600.
HETEROFLOW_ADMIN_API_KEY (sk-admin-…) registers that key for the administrator.
"""

import os
import secrets
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from apps.tenants import keys, services
from apps.tenants.choices import KeyScope
from apps.tenants.models import ApiKey

MIN_API_KEY_LENGTH = 32
CREDENTIALS_FILE = "admin-credentials"


class Command(BaseCommand):
    help = "Create the platform administrator and the bootstrap operator API key (idempotent)."

    def handle(self, *args, **options):
        User = get_user_model()
        username = settings.HETEROFLOW_ADMIN_USER
        password = settings.HETEROFLOW_ADMIN_PASSWORD
        credentials = Path(settings.HETEROFLOW_DATA_DIR) / CREDENTIALS_FILE
        user = User.objects.filter(username=username).first()
        if user is None:
            generated = password is None
            password = password or secrets.token_urlsafe(16)
            user = User.objects.create_superuser(
                username=username, email=settings.HETEROFLOW_ADMIN_EMAIL, password=password
            )
            if generated:
                credentials.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(credentials, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as handle:
                    handle.write(f"username={username}\npassword={password}\n")
                self.stdout.write(
                    f"Created platform administrator '{username}' with password: {password}\n"
                    f"(shown once; also stored in {credentials}, readable only by you)"
                )
            else:
                self.stdout.write(
                    f"Created platform administrator '{username}' (password from HETEROFLOW_ADMIN_PASSWORD)."
                )
        else:
            if not (user.is_staff and user.is_superuser and user.is_active):
                user.is_staff = user.is_superuser = user.is_active = True
                user.save(update_fields=["is_staff", "is_superuser", "is_active"])
            if password is not None and not user.check_password(password):
                user.set_password(password)
                user.save(update_fields=["password"])
                self.stdout.write(f"Updated the password of '{username}' from HETEROFLOW_ADMIN_PASSWORD.")
            else:
                where = f" (see {credentials})" if credentials.exists() else ""
                self.stdout.write(f"Platform administrator '{username}' exists{where}.")
        if settings.HETEROFLOW_ADMIN_API_KEY:
            self._ensure_api_key(user, settings.HETEROFLOW_ADMIN_API_KEY)

    def _ensure_api_key(self, user, key: str) -> None:
        if keys.scope_of(key) != KeyScope.PLATFORM or len(key) < MIN_API_KEY_LENGTH:
            raise CommandError(
                f"HETEROFLOW_ADMIN_API_KEY must start with 'sk-admin-' and be at least {MIN_API_KEY_LENGTH} characters long."
            )
        existing = ApiKey.objects.filter(key_hash=keys.hash_key(key)).first()
        if existing is None:
            services.issue_platform_key(user=user, name="bootstrap (HETEROFLOW_ADMIN_API_KEY)", key=key)
            self.stdout.write("Registered the operator API key from HETEROFLOW_ADMIN_API_KEY.")
        elif existing.revoked_at is not None:
            self.stderr.write("HETEROFLOW_ADMIN_API_KEY names a key that was revoked; it stays revoked.")
