"""Dashboard sessions (cookies signed with itsdangerous), inference-only sub-keys and a login throttle.

Nothing here logs a key, a cookie or a hash. Every comparison of a secret is constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from itsdangerous import BadSignature, URLSafeTimedSerializer

from omlx.errors import InvalidRequestError, NotFoundError

SESSION_MAX_AGE = 12 * 3600
SUBKEY_PREFIX = "omlx-sk-"


def secret_from_env() -> bytes:
    """`OMLX_SECRET_KEY` keeps sessions valid across restarts; otherwise a random one per start."""
    configured = os.environ.get("OMLX_SECRET_KEY")
    return configured.encode() if configured else secrets.token_bytes(32)


class SessionSigner:
    """Issues and checks session tokens: itsdangerous's timestamped, HMAC-SHA256-signed payloads.

    The signing key is derived from the secret *and* the API key (its hash is the salt), so
    changing the API key invalidates every session issued under the old one.
    """

    def __init__(self, secret: bytes, api_key: str | None, max_age: int = SESSION_MAX_AGE):
        bound = hashlib.sha256((api_key or "").encode()).hexdigest()
        self._serializer = URLSafeTimedSerializer(
            secret, salt=f"omlx-session:{bound}", signer_kwargs={"digest_method": hashlib.sha256}
        )
        self.max_age = max_age
        self._revoked: dict[str, float] = {}  # sid -> when its token expires anyway, for logout
        self._lock = threading.Lock()

    def issue(self) -> str:
        return self._serializer.dumps({"sid": secrets.token_hex(16)})

    def _payload(self, token: str | None) -> dict[str, Any] | None:
        if not token:
            return None
        try:
            payload = self._serializer.loads(token, max_age=self.max_age)
        except BadSignature:  # tampered, foreign or expired (SignatureExpired is one)
            return None
        if not isinstance(payload, dict) or not isinstance(payload.get("sid"), str):
            return None
        with self._lock:
            if payload["sid"] in self._revoked:
                return None
        return payload

    def verify(self, token: str | None) -> bool:
        return self._payload(token) is not None

    def revoke(self, token: str | None) -> None:
        payload = self._payload(token)
        if payload is None:
            return
        now = time.time()
        with self._lock:
            self._revoked = {s: e for s, e in self._revoked.items() if e > now}
            self._revoked[payload["sid"]] = now + self.max_age


def _hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKeyStore:
    """Named, revocable, inference-only sub-keys in `$OMLX_HOME/api_keys.json`, stored hashed.

    Keys are 256-bit random tokens, so a plain SHA-256 is enough to make the file useless
    to a reader; the plaintext is shown once, at creation.
    """

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self._keys: list[dict[str, Any]] = []
        self._last_used: dict[str, float] = {}
        if path.exists():
            try:
                data = json.loads(path.read_text())
                keys = data.get("keys", []) if isinstance(data, dict) else None
                if not isinstance(keys, list):
                    raise ValueError("expected {\"keys\": [...]}")
                self._keys = [k for k in keys if isinstance(k, dict) and {"id", "name", "hash"} <= set(k)]
            except (OSError, ValueError) as exc:
                from omlx.errors import ConfigError

                raise ConfigError(f"Cannot read {path}: {exc}. Fix or delete the file.") from None

    def _public(self, k: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": k["id"],
            "name": k["name"],
            "prefix": k.get("prefix", ""),
            "created": k.get("created"),
            "last_used": self._last_used.get(k["id"]),
        }

    def list(self) -> list[dict[str, Any]]:
        with self._lock:
            return [self._public(k) for k in self._keys]

    def create(self, name: Any) -> tuple[dict[str, Any], str]:
        if not isinstance(name, str) or not name.strip() or len(name.strip()) > 64:
            raise InvalidRequestError("A key needs a name of 1 to 64 characters.", param="name")
        name = name.strip()
        key = SUBKEY_PREFIX + secrets.token_urlsafe(32)
        record = {
            "id": secrets.token_hex(6),
            "name": name,
            "hash": _hash_key(key),
            "prefix": key[: len(SUBKEY_PREFIX) + 4],
            "created": time.time(),
        }
        with self._lock:
            if any(k["name"] == name for k in self._keys):
                raise InvalidRequestError(f"A key named '{name}' already exists.", param="name")
            self._keys.append(record)
            self._save()
            return self._public(record), key

    def delete(self, key_id: str) -> None:
        with self._lock:
            kept = [k for k in self._keys if k["id"] != key_id]
            if len(kept) == len(self._keys):
                raise NotFoundError(f"No API key with id '{key_id}'.")
            self._keys = kept
            self._last_used.pop(key_id, None)
            self._save()

    def verify(self, presented: str | None) -> bool:
        """True when `presented` is a live sub-key; every stored hash is compared."""
        if not presented:
            return False
        digest = _hash_key(presented).encode()
        match = None
        with self._lock:
            for k in self._keys:
                if hmac.compare_digest(digest, str(k["hash"]).encode()):
                    match = k["id"]
            if match is not None:
                self._last_used[match] = time.time()
        return match is not None

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"keys": self._keys}, f, indent=2)
        os.replace(tmp, self.path)


class LoginThrottle:
    """At most `limit` failed logins per client in `window` seconds; then wait."""

    def __init__(self, limit: int = 5, window: float = 60.0):
        self.limit = limit
        self.window = window
        self._failures: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def retry_after(self, client: str) -> int:
        now = time.time()
        with self._lock:
            q = self._failures.get(client)
            if not q:
                return 0
            while q and q[0] < now - self.window:
                q.popleft()
            if len(q) < self.limit:
                return 0
            return max(1, int(q[0] + self.window - now) + 1)

    def failed(self, client: str) -> None:
        with self._lock:
            self._failures.setdefault(client, deque()).append(time.time())

    def succeeded(self, client: str) -> None:
        with self._lock:
            self._failures.pop(client, None)
