"""What the dashboard's chat needs from the admin API, in-process (no model loaded):
prompt presets as profiles with a system prompt, renamed in place."""

from __future__ import annotations

import io
import json
import sys

import pytest

from tests.admin.conftest import API_KEY, fake_model

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_a_preset_is_a_profile_with_a_system_prompt_and_renames_in_place(in_process_app, omlx_home):
    client, models = in_process_app
    fake_model(models / "m")
    base = "/api/models/m/profiles"
    assert client.post(f"{base}/terse", json={"system_prompt": "Be terse.", "temperature": 0.2}, headers=AUTH).status_code == 200
    assert client.post(f"{base}/later", json={"system_prompt": "Later."}, headers=AUTH).status_code == 200
    r = client.post(f"{base}/terse/rename", json={"to": "short"}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["settings"]["system_prompt"] == "Be terse." and r.json()["profile"] == "short"
    profiles = client.get("/api/models/m/settings", headers=AUTH).json()["settings"]["profiles"]
    assert list(profiles) == ["short", "later"]  # its place kept
    assert profiles["short"]["temperature"] == 0.2
    on_disk = json.loads((omlx_home / "model_settings.json").read_text())
    assert on_disk["m"]["profiles"]["short"] == {"temperature": 0.2, "system_prompt": "Be terse."}
    for body, status, param in [({"to": "later"}, 400, "to"), ({"to": "a:b"}, 400, "to"), ({}, 400, "to")]:
        r = client.post(f"{base}/short/rename", json=body, headers=AUTH)
        assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    assert client.post(f"{base}/gone/rename", json={"to": "x"}, headers=AUTH).status_code == 404
    r = client.put(f"{base}/short", json={"system_prompt": 5}, headers=AUTH)
    assert r.status_code == 400 and "system_prompt" in r.json()["error"]["message"]
    # the model's own system prompt: its "System default"
    assert client.put("/api/models/m/settings", json={"system_prompt": "Default."}, headers=AUTH).status_code == 200


def tiny_pdf(text: str) -> bytes:
    """A one-page PDF showing `text` (Helvetica), with a correct cross-reference table."""
    stream = f"BT /F1 12 Tf 20 100 Td ({text}) Tj ET".encode()
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 300 144] /Contents 4 0 R /Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n%s\nendstream" % (len(stream), stream),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (i, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def tiny_docx(text: str) -> bytes:
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("[Content_Types].xml", '<?xml version="1.0"?><Types xmlns="http://schemas.openxmlformats.org/package/2006/content-types">'
                   '<Default Extension="rels" ContentType="application/vnd.openxmlformats-package.relationships+xml"/>'
                   '<Default Extension="xml" ContentType="application/xml"/>'
                   '<Override PartName="/word/document.xml" ContentType="application/vnd.openxmlformats-officedocument.wordprocessingml.document.main+xml"/></Types>')
        z.writestr("_rels/.rels", '<?xml version="1.0"?><Relationships xmlns="http://schemas.openxmlformats.org/package/2006/relationships">'
                   '<Relationship Id="rId1" Type="http://schemas.openxmlformats.org/officeDocument/2006/relationships/officeDocument" Target="word/document.xml"/></Relationships>')
        z.writestr("word/document.xml", '<?xml version="1.0"?><w:document xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main">'
                   f'<w:body><w:p><w:r><w:t>{text}</w:t></w:r></w:p></w:body></w:document>')
    return buf.getvalue()


def tiny_xlsx(rows: list[list]) -> bytes:
    import openpyxl

    wb = openpyxl.Workbook()
    for row in rows:
        wb.active.append(row)
    buf = io.BytesIO()
    wb.save(buf)
    return buf.getvalue()


def test_documents_are_read_as_text_within_limits_with_clear_errors(in_process_app, monkeypatch):
    pytest.importorskip("markitdown", reason="the documents extra (the test extra installs it)")
    client, _ = in_process_app

    def post(name: str, data: bytes):
        return client.post(f"/api/chat/convert?name={name}", content=data, headers={**AUTH, "Content-Type": "application/octet-stream"})

    cases = {
        "notes.txt": (b"plain words\n", "text", "plain words"),
        "readme.md": (b"# Title\n\nbody", "markdown", "# Title"),
        "page.html": (b"<html><body><h1>Head</h1><p>Some <b>bold</b></p><script>x()</script></body></html>", "html", "**bold**"),
        "report.pdf": (tiny_pdf("Quarterly numbers rose"), "pdf", "Quarterly numbers rose"),
        "letter.docx": (tiny_docx("Dear reader"), "docx", "Dear reader"),
        "sheet.xlsx": (tiny_xlsx([["city", "people"], ["Lyon", 522000]]), "xlsx", "| Lyon | 522000 |"),
    }
    for name, (data, fmt, expected) in cases.items():
        r = post(name, data)
        assert r.status_code == 200, (name, r.text)
        body = r.json()
        assert body["name"] == name and body["format"] == fmt and expected in body["text"], (name, body)
        assert body["chars"] == len(body["text"])
    assert "x()" not in post("page.html", cases["page.html"][0]).json()["text"]
    refusals = [
        ("tool.exe", b"MZ", 400, "not a known document type"),
        ("broken.pdf", b"%PDF-1.4 garbage" * 10, 400, "Could not read broken.pdf"),
        ("binary.txt", b"\x00\x01\x02", 400, "not a text file"),
        ("empty.md", b"", 400, "is empty"),
        ("blank.pdf", tiny_pdf(""), 400, "has no text"),
        ("huge.txt", b"a" * ((10 << 20) + 1), 413, "at most 10,485,760"),
        ("long.txt", b"a" * 200_001, 413, "at most 200,000"),
    ]
    for name, data, status, words in refusals:
        r = post(name, data)
        assert r.status_code == status and words in r.json()["error"]["message"], (name, r.status_code, r.text)
    assert client.post("/api/chat/convert", content=b"x", headers={**AUTH, "Content-Type": "application/octet-stream"}).status_code == 400
    # a binary body is not taken for deeply nested JSON
    assert post("deep.txt", b"[" * 500).status_code == 200
    assert client.post("/api/chat/convert?name=a.txt", content=b"x").status_code == 401  # admin only
    monkeypatch.setitem(sys.modules, "markitdown", None)  # the extra not installed
    r = post("report.pdf", cases["report.pdf"][0])
    assert r.status_code == 501 and "omlx[documents]" in r.json()["error"]["message"]
    assert post("notes.txt", b"still fine").status_code == 200
