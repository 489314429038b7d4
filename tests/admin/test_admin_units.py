"""No-server tests: session signing, sub-key storage, the log buffer, metrics, the static bundle."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from pathlib import Path

import pytest

from omlx.admin import STATIC
from omlx.admin.log_buffer import LogBuffer
from omlx.admin.metrics import RequestMetrics
from omlx.admin.security import ApiKeyStore, LoginThrottle, SessionSigner
from omlx.errors import ConfigError, InvalidRequestError, NotFoundError


def test_sessions_verify_and_reject_tampering():
    signer = SessionSigner(b"secret", "key")
    token = signer.issue()
    assert signer.verify(token)
    body, stamp, sig = token.split(".")
    assert not signer.verify(f"{body}.{stamp}.{sig[::-1]}")
    assert not signer.verify(f"{body}x.{stamp}.{sig}")
    assert not signer.verify(None) and not signer.verify("") and not signer.verify("a.b.c")
    assert not SessionSigner(b"other", "key").verify(token)


def test_sessions_are_bound_to_the_api_key_and_expire():
    token = SessionSigner(b"secret", "key").issue()
    assert not SessionSigner(b"secret", "changed-key").verify(token)
    short = SessionSigner(b"secret", "key", max_age=-1)
    assert not short.verify(short.issue())


def test_revoked_sessions_stay_revoked():
    signer = SessionSigner(b"secret", "key")
    a, b = signer.issue(), signer.issue()
    signer.revoke(a)
    assert not signer.verify(a) and signer.verify(b)


def test_subkeys_are_stored_hashed_and_survive_a_restart(tmp_path: Path):
    path = tmp_path / "api_keys.json"
    store = ApiKeyStore(path)
    record, key = store.create("ci")
    assert store.verify(key) and not store.verify(key + "x") and not store.verify(None)
    text = path.read_text()
    assert key not in text and json.loads(text)["keys"][0]["name"] == "ci"
    again = ApiKeyStore(path)
    assert again.verify(key)
    again.delete(record["id"])
    assert not again.verify(key) and not ApiKeyStore(path).verify(key)
    with pytest.raises(NotFoundError):
        again.delete(record["id"])
    with pytest.raises(InvalidRequestError):
        again.create("  ")


def test_a_broken_keys_file_is_a_config_error(tmp_path: Path):
    path = tmp_path / "api_keys.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="api_keys.json"):
        ApiKeyStore(path)


def test_login_throttle_blocks_after_repeated_failures():
    throttle = LoginThrottle(limit=3, window=60)
    for _ in range(3):
        assert throttle.retry_after("1.2.3.4") == 0
        throttle.failed("1.2.3.4")
    assert throttle.retry_after("1.2.3.4") > 0
    assert throttle.retry_after("5.6.7.8") == 0
    throttle.succeeded("1.2.3.4")
    assert throttle.retry_after("1.2.3.4") == 0


def test_log_buffer_is_bounded_and_tails_by_sequence():
    buf = LogBuffer(capacity=5)
    logger = logging.getLogger("omlx.test.buffer")
    logger.propagate = False
    logger.addHandler(buf)
    logger.setLevel(logging.INFO)
    try:
        for i in range(8):
            logger.info("line %d", i)
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("failed")
    finally:
        logger.removeHandler(buf)
    got = buf.since(0)
    assert got["last"] == 9 and len(got["lines"]) == 5
    assert [line["seq"] for line in got["lines"]] == [5, 6, 7, 8, 9]
    assert "ValueError: boom" in got["lines"][-1]["message"] and got["lines"][-1]["level"] == "ERROR"
    assert [line["message"] for line in buf.since(7)["lines"]][0] == "line 7"
    assert buf.since(9)["lines"] == [] and len(buf.since(0, limit=2)["lines"]) == 2


def test_metrics_total_and_per_model():
    m = RequestMetrics()
    m.record("a", {"finish_reason": "stop", "prompt_tokens": 10, "cached_tokens": 4, "completion_tokens": 5,
                   "ttft_s": 0.2, "decode_tps": 50.0})
    m.record("b", {"finish_reason": "cancelled", "prompt_tokens": 3, "cached_tokens": 0, "completion_tokens": 0,
                   "ttft_s": 0.0, "decode_tps": 0.0})
    snap = m.snapshot()
    assert snap["requests"] == 2 and snap["prompt_tokens"] == 13 and snap["finished"] == {"stop": 1, "cancelled": 1}
    assert snap["models"]["a"]["avg_ttft_s"] == pytest.approx(0.2) and snap["last_decode_tps"] == 50.0


def test_the_dashboard_is_self_contained():
    """Offline: nothing referenced from another host, and every referenced file ships."""
    files = {str(p.relative_to(STATIC)) for p in STATIC.rglob("*") if p.is_file()}
    index = (STATIC / "index.html").read_text()
    for ref in re.findall(r'(?:src|href)="([^"#]+)"', index):
        assert ref.startswith("/admin/static/"), ref
        assert ref.removeprefix("/admin/static/") in files, ref
    for path in STATIC.iterdir():  # our own files; the vendored ones are checked against their manifest
        if path.is_dir():
            continue
        text = path.read_text()
        for url in re.findall(r"https?://[^\s\"'`)]+", text):
            # Only placeholders and documentation text may name outside hosts, never a load.
            assert "cdn" not in url and not re.search(r"\.(js|css|woff2?|ttf)\b", url), (path.name, url)
        assert "@import" not in text and "fonts.googleapis" not in text


def test_vendored_libraries_are_the_pinned_npm_files_with_their_licences():
    manifest = json.loads((STATIC / "vendor" / "VENDOR.json").read_text())
    listed = set()
    for name, lib in manifest.items():
        assert re.fullmatch(r"(@[\w-]+/)?[\w.-]+@\d+\.\d+\.\d+", lib["npm"]) and lib["license"]
        assert any(f.startswith("LICENSE") for f in lib["files"]), name
        for file, meta in lib["files"].items():
            data = (STATIC / "vendor" / name / file).read_bytes()
            assert hashlib.sha256(data).hexdigest() == meta["sha256"], (name, file)
            listed.add(f"{name}/{file}")
    on_disk = {str(p.relative_to(STATIC / "vendor")) for p in (STATIC / "vendor").rglob("*") if p.is_file()}
    assert on_disk - {"VENDOR.json"} == listed


def test_package_data_ships_the_static_files():
    import fnmatch
    import tomllib

    root = Path(__file__).resolve().parents[2]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["omlx"]
    for path in STATIC.rglob("*"):
        if path.is_file():
            rel = str(path.relative_to(root / "omlx"))
            assert any(fnmatch.fnmatch(rel, g) and rel.count("/") == g.count("/") for g in globs), rel


def test_sessions_issued_now_expire_after_their_max_age(monkeypatch):
    signer = SessionSigner(b"s", "k", max_age=60)
    token = signer.issue()
    assert signer.verify(token)
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + 59)
    assert signer.verify(token)
    monkeypatch.setattr(time, "time", lambda: now + 62)
    assert not signer.verify(token)


def test_every_string_the_chat_shows_is_in_strings_js():
    """strings.js holds every visible string of the chat and the theme switch (one place to translate)."""
    defined = set(re.findall(r'^\s+"([\w.]+)":', (STATIC / "strings.js").read_text(), re.M))
    used = set()
    for name in ["theme.js", "chat.js", "chat-view.js", "chat-side.js", "chat-stream.js"]:
        used |= set(re.findall(r'\bT\("([\w.]+)"', (STATIC / name).read_text()))
    assert used and used <= defined, sorted(used - defined)
    assert {f"settings.thinking.{m}" for m in ("auto", "off", "on", "budget")} <= defined
