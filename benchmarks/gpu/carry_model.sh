#!/usr/bin/env bash
# Split an MLX model folder (a real model, e.g. SmolLM2-135M-Instruct's 98 MB) into two carry folders
# for the lent GPU machine, whose calls carry at most 64 MiB each (README.md beside this file):
#   bash benchmarks/gpu/carry_model.sh MODEL_DIR          # here: writes .gpu3/ and .gpu4/ (git-ignored)
#   run, carry [".gpu3"]:  mkdir -p ~/omlx-stash && cp .gpu3/* ~/omlx-stash/
#   run, carry [".gpu4"]:  bash .gpu4/join.sh && …   # the folder is then ~/models/<name>
set -euo pipefail
src=$(cd "$1" && pwd)
name=$(basename "$src")
root=$(git rev-parse --show-toplevel)
cd "$root"
for d in /.gpu3/ /.gpu4/; do grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
rm -rf .gpu3 .gpu4 && mkdir -p .gpu3 .gpu4
tar -C "$(dirname "$src")" -cf - "$name" | split -b 60000000 - .gpu4/model.part_
[ ! -e .gpu4/model.part_ac ] || { echo "$name is over 120 MB: two halves cannot carry it"; exit 2; }
mv .gpu4/model.part_aa .gpu3/
sha256sum < <(cat .gpu3/model.part_aa .gpu4/model.part_a[b-z]) | cut -d' ' -f1 > .gpu4/model.sha256
cat > .gpu4/join.sh <<'INNER'
#!/usr/bin/env bash
# On the device machine: joins the model halves into ~/models (the .gpu3 call first, same warm machine).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
[ -f ~/omlx-stash/model.part_aa ] || { echo "first half missing: run the .gpu3 call first"; exit 3; }
got=$(cat ~/omlx-stash/model.part_aa "$here"/model.part_a[b-z] | sha256sum | cut -d' ' -f1)
[ "$got" = "$(cat "$here/model.sha256")" ] || { echo "the joined model differs from the one split"; exit 4; }
mkdir -p ~/models && cat ~/omlx-stash/model.part_aa "$here"/model.part_a[b-z] | tar -C ~/models -xf -
ls ~/models
INNER
chmod +x .gpu4/join.sh
du -sh .gpu3 .gpu4
