#!/usr/bin/env bash
# Refresh the plotly.js bundle that every HTML report inlines (reports/plotly-basic.min.js).
#
# Why the *basic* partial bundle: a report must open offline in any browser and load fast.
# The full plotly.min.js is 4.8 MB; the basic bundle (bar, scatter and pie traces: all the
# report uses) is 1.2 MB, a plain script that any browser plotly supports runs as is (no
# DecompressionStream, no modules, no network). plotly's Python package ships only the full
# bundle, so the partial one comes from the npm package plotly.js-basic-dist-min (MIT).
#
#   scripts/update_plotly_js.sh [VERSION]      # default: the version the full bundle has
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VERSION=${1:-$($PY -c 'import re; from plotly.offline import get_plotlyjs as g; print(re.search(r"plotly\.js v([0-9.]+)", g()[:400]).group(1))')}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "plotly.js-basic-dist-min@$VERSION" >/dev/null && tar xzf ./*.tgz)
cp "$tmp/package/plotly-basic.min.js" reports/plotly-basic.min.js
cp "$tmp/package/LICENSE" reports/plotly-basic.LICENSE.txt
echo "reports/plotly-basic.min.js: plotly.js basic v$VERSION ($(wc -c < reports/plotly-basic.min.js) bytes)"
