"""Re-vendor the dashboard's JavaScript libraries from npm, as pinned in
omlx/admin/static/vendor/VENDOR.json (package@version, tarball integrity, files), and check
the files' sha256. Needs `npm`; run it after changing a version there, then update the hashes
it reports. Nothing here runs when oMLX serves: the built files are committed.

    python scripts/vendor_js.py            # fetch, verify, copy
    python scripts/vendor_js.py --check    # fetch and compare only
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VENDOR = Path(__file__).resolve().parents[1] / "omlx" / "admin" / "static" / "vendor"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the committed files, copy nothing")
    args = ap.parse_args()
    manifest = json.loads((VENDOR / "VENDOR.json").read_text())
    problems = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, lib in manifest.items():
            out = subprocess.run(["npm", "pack", lib["npm"], "--silent"], cwd=tmp, capture_output=True, text=True,
                                 check=True).stdout.strip().splitlines()[-1]
            tarball = Path(tmp) / out
            algo, digest = lib["tarball_integrity"].split("-", 1)
            if base64.b64encode(hashlib.new(algo, tarball.read_bytes()).digest()).decode() != digest:
                print(f"{lib['npm']}: the tarball's integrity differs from VENDOR.json", file=sys.stderr)
                return 1
            with tarfile.open(tarball) as tar:
                for file, meta in lib["files"].items():
                    data = tar.extractfile(meta["from"]).read()  # type: ignore[union-attr]
                    sha = hashlib.sha256(data).hexdigest()
                    if sha != meta["sha256"]:
                        problems += 1
                        print(f"{name}/{file}: sha256 {sha}, VENDOR.json says {meta['sha256']}")
                    if not args.check:
                        (VENDOR / name).mkdir(exist_ok=True)
                        with open(VENDOR / name / file, "wb") as f:
                            f.write(data)
    print("all files match VENDOR.json" if not problems else f"{problems} files differ")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
