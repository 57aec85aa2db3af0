#!/usr/bin/env bash
# Build every artifact and smoke-test each without network (packaging/smoke.py): the wheel installed
# into a fresh venv with no C compiler, the one-folder bundle, the one-file executable and the zipapp.
#     bash packaging/check.sh [OUT]       (OUT: default a new temporary folder, removed at the end)
# Run by .ci/run; needs ember's test extra in the calling Python (the smoke test's OpenAI client).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-$(mktemp -d)}
[ $# -ge 1 ] || trap 'rm -rf "$out"' EXIT
model=$(python -c "from ember import hub; print(hub.pull('smollm2'))")  # the cache's copy, else a download
t0=$SECONDS
python packaging/build.py --out "$out"
echo "packaging: built in $((SECONDS - t0)) s"

python -m venv "$out/wheel-venv"
CC=false PATH="$out/wheel-venv/bin:/usr/bin:/bin" "$out/wheel-venv/bin/pip" install --quiet --disable-pip-version-check \
    --no-index --find-links "$out/.work/wheelhouse" "$out"/ember-*.whl
python packaging/smoke.py --model "$model" -- "$out/wheel-venv/bin/ember"

tar xzf "$out"/ember-*-linux-x86_64.tar.gz -C "$out"
python packaging/smoke.py --model "$model" -- "$out"/ember-*-linux-x86_64/ember
python packaging/smoke.py --model "$model" -- "$out/ember"
# the zipapp under the plain interpreter (not this venv's, which has ember installed)
python packaging/smoke.py --model "$model" -- "$(python -c 'import os, sys; print(os.path.realpath(sys._base_executable))')" "$out"/ember-*.pyz
(cd "$out" && sha256sum --check --quiet SHA256SUMS)
echo "packaging: built and smoke-tested in $((SECONDS - t0)) s"
