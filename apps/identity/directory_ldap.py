"""LDAP / Active Directory sign-in through django-auth-ldap (docs/identity.md#ldap).

The sign-in form's username and password are checked by a bind as the person (found by a
search, as the bind DN or anonymously; over StartTLS or LDAPS, the server's certificate
checked against HETEROFLOW_LDAP_CA_FILE or the system's CAs); their groups are found by a
group search, and the mappings give their memberships (apps.identity.services.sign_in),
exactly as for OpenID Connect. A person with no mapped group is refused: the backend
stops the sign-in (PermissionDenied) and leaves the refusal on the request for the page.

django-auth-ldap's own AUTH_LDAP_* settings are built here from HETEROFLOW_LDAP_*, so
that the environment is the one place they come from."""

from __future__ import annotations

import ldap
from django.conf import settings
from django.core.exceptions import PermissionDenied
from django_auth_ldap.backend import LDAPBackend
from django_auth_ldap.config import (
    GroupOfNamesType,
    GroupOfUniqueNamesType,
    LDAPSearch,
    NestedActiveDirectoryGroupType,
    PosixGroupType,
)

from apps.identity import services

SOURCE = "ldap"

GROUP_TYPES = {
    "groupofnames": GroupOfNamesType,
    "groupofuniquenames": GroupOfUniqueNamesType,
    "posixgroup": PosixGroupType,
    "activedirectory": NestedActiveDirectoryGroupType,
}


def backend_settings() -> dict:
    """django-auth-ldap's settings (without their AUTH_LDAP_ prefix) from HETEROFLOW_LDAP_*."""
    options = {
        ldap.OPT_REFERRALS: 0,  # Active Directory's referrals lead to other servers' errors
        ldap.OPT_NETWORK_TIMEOUT: settings.HETEROFLOW_LDAP_TIMEOUT_SECONDS,
        ldap.OPT_TIMEOUT: settings.HETEROFLOW_LDAP_TIMEOUT_SECONDS,
        ldap.OPT_X_TLS_REQUIRE_CERT: ldap.OPT_X_TLS_DEMAND,
    }
    if settings.HETEROFLOW_LDAP_CA_FILE:
        options[ldap.OPT_X_TLS_CACERTFILE] = settings.HETEROFLOW_LDAP_CA_FILE
    options[ldap.OPT_X_TLS_NEWCTX] = 0  # last: makes the TLS options above take effect
    return {
        "SERVER_URI": settings.HETEROFLOW_LDAP_SERVER_URI,
        "BIND_DN": settings.HETEROFLOW_LDAP_BIND_DN,
        "BIND_PASSWORD": settings.HETEROFLOW_LDAP_BIND_PASSWORD,
        "START_TLS": settings.HETEROFLOW_LDAP_START_TLS,
        "CONNECTION_OPTIONS": options,
        "USER_SEARCH": LDAPSearch(
            settings.HETEROFLOW_LDAP_USER_SEARCH_BASE, ldap.SCOPE_SUBTREE, settings.HETEROFLOW_LDAP_USER_FILTER
        ),
        "GROUP_SEARCH": LDAPSearch(
            settings.HETEROFLOW_LDAP_GROUP_SEARCH_BASE, ldap.SCOPE_SUBTREE, settings.HETEROFLOW_LDAP_GROUP_FILTER
        ),
        "GROUP_TYPE": GROUP_TYPES[settings.HETEROFLOW_LDAP_GROUP_TYPE](),
        "USER_ATTR_MAP": {"email": "mail", "first_name": "givenName", "last_name": "sn"},
        "ALWAYS_UPDATE_USER": True,
        "CACHE_TIMEOUT": 0,  # groups are read at each sign-in: a change counts at the next one
    }


class DirectoryLDAPBackend(LDAPBackend):
    settings_prefix = "HETEROFLOW_DJANGO_AUTH_LDAP_"  # nothing of Django's settings: ours below

    @property
    def default_settings(self):
        return backend_settings()

    def authenticate(self, request, username=None, password=None, **kwargs):
        if not settings.HETEROFLOW_LDAP_SERVER_URI:
            return None
        self._sign_in_request = request
        return super().authenticate(request, username=username, password=password, **kwargs)

    def get_or_build_user(self, username, ldap_user):
        """After the person's bind: the user the mappings make of them (never a local
        account that only shares the name), or the sign-in refused."""
        mail = ldap_user.attrs.get("mail") or [""]
        account = services.DirectoryAccount(
            source=SOURCE,
            subject=username.strip().lower(),
            username=username.strip(),
            email=mail[0],
            groups=tuple(sorted(ldap_user.group_dns)),
        )
        try:
            return services.sign_in(account), False
        except services.SignInRefused as refused:
            request = getattr(self, "_sign_in_request", None)
            if request is not None:
                setattr(request, services.REFUSAL_ATTRIBUTE, refused.reason)
            raise PermissionDenied(refused.reason) from None
