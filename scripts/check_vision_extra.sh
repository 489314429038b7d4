#!/usr/bin/env bash
# Check that the full `omlx[vision]` extra resolves and leaves the installed mlx as it is
# (mlx-vlm pulls mlx-audio, which pins one exact mlx). Exit 1 when it would move mlx, 2 when
# pip cannot resolve it (offline). Usage: bash scripts/check_vision_extra.sh
set -uo pipefail
cd "$(dirname "$0")/.."
report=$(mktemp)
trap 'rm -f "$report"' EXIT
mlx=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('mlx'))")
if ! .venv/bin/python -m pip install -q --dry-run --report "$report" "mlx-vlm>=0.7.10,<0.8" "Pillow>=10.3" >/dev/null 2>&1; then
  echo "check_vision_extra: pip could not resolve mlx-vlm's dependencies" >&2
  exit 2
fi
.venv/bin/python - "$report" "$mlx" <<'PY'
import json, sys
report, mlx = json.load(open(sys.argv[1])), sys.argv[2]
moved = [i["metadata"]["version"] for i in report["install"] if i["metadata"]["name"] in ("mlx", "mlx-cpu", "mlx-metal", "mlx-cuda")]
if moved:
    sys.exit(f"check_vision_extra: the vision extra would install mlx {moved} over {mlx}")
print(f"check_vision_extra: omlx[vision] resolves with mlx {mlx} unchanged "
      f"({len(report['install'])} packages to add)")
PY
