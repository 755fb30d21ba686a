"""Key material is one rule (apps/core/key_material.py) for every key shown once and kept
hashed: tenant and platform API keys (apps.tenants.keys) and endpoint keys
(apps.gateway.keys) are made, hashed and shown in clear the same way, under their own
prefixes."""

import ast
import hashlib

from apps.core import key_material
from apps.gateway import keys as endpoint_keys
from apps.gateway.choices import ENDPOINT_KEY_PREFIX
from apps.tenants import keys as api_keys
from apps.tenants.choices import KEY_PREFIX, KeyScope
from tests.spelling import calls, name_of, sources, tree

HOME = "apps/core/key_material.py"


def test_the_stored_formats_stay_as_they_were():
    assert key_material.hash_key("sk-tenant-x") == hashlib.sha256(b"sk-tenant-x").hexdigest()
    assert api_keys.display_prefix("sk-tenant-abcdefghijkl") == "sk-tenant-abcdefgh"
    assert api_keys.display_prefix("no-prefix-at-all") == "no-prefi"
    assert endpoint_keys.display_prefix("sk-hf-abcdefghijkl") == "sk-hf-abcdefgh"


def test_every_kind_of_key_is_made_hashed_and_shown_alike():
    for key, prefix in (
        (api_keys.generate(KeyScope.TENANT), KEY_PREFIX[KeyScope.TENANT]),
        (api_keys.generate(KeyScope.PLATFORM), KEY_PREFIX[KeyScope.PLATFORM]),
        (endpoint_keys.generate(), ENDPOINT_KEY_PREFIX),
    ):
        assert key.startswith(prefix) and len(key) == len(prefix) + 43  # 32 bytes, URL-safe base64
        assert api_keys.hash_key(key) == endpoint_keys.hash_key(key) == key_material.hash_key(key)
        assert key_material.display_prefix(key, prefix) == key[: len(prefix) + key_material.DISPLAY_CHARS]


def test_no_other_module_makes_hashes_or_cuts_a_key_itself():
    # (a password made with secrets.token_urlsafe is no key: it has no prefix and is never looked up)
    copies = []
    for path in sources():
        if name_of(path) == HOME:
            continue
        for node in ast.walk(tree(path)):
            if isinstance(node, ast.Name) and node.id in ("SECRET_BYTES", "DISPLAY_CHARS"):
                copies.append(f"{name_of(path)}:{node.lineno}: {node.id}")
        for call in calls(path, "sha256"):
            if any(word in ast.unparse(call) for word in ("key", "token")):
                copies.append(f"{name_of(path)}:{call.lineno}: {ast.unparse(call)}")
        for node in ast.walk(tree(path)):  # a prefix + a random string: a key made in place
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and "token_urlsafe" in ast.unparse(node):
                copies.append(f"{name_of(path)}:{node.lineno}: {ast.unparse(node)}")
    assert copies == []
