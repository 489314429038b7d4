"""Download one model snapshot; run as a child process so a download can be cancelled by killing it.

Usage: `python -m omlx.admin.hf_fetch` with a JSON spec on stdin:
`{"repo_id", "revision", "local_dir", "endpoint", "files": [names]}`. Exit 0 prints the
folder; a failure prints one `error: ...` line on stderr and exits 1. The child exits by
itself when its parent (the server) goes away.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import threading
import time


def _exit_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def main() -> int:
    _exit_with_parent()
    spec = json.loads(sys.stdin.read())
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(
            spec["repo_id"],
            revision=spec.get("revision"),
            local_dir=spec["local_dir"],
            endpoint=spec.get("endpoint"),
            allow_patterns=[glob.escape(f) for f in spec["files"]] if spec.get("files") else None,
            max_workers=4,
        )
    except Exception as exc:  # reported to the server as one line
        message = " ".join(str(exc).split())
        print(f"error: {type(exc).__name__}: {message[:500]}", file=sys.stderr)
        return 1
    print(json.dumps({"path": str(path)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
