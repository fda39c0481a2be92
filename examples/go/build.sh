#!/usr/bin/env bash
# Builds examples/go (main.go) into one binary, GOPATH-style, from Debian's Go packages only:
#
#   apt-get install golang-go golang-google-grpc-dev \
#     golang-github-golang-protobuf-1-5-dev protobuf-compiler protoc-gen-go protoc-gen-go-grpc
#   examples/go/build.sh [OUTPUT]     # default OUTPUT: .cache/go/bin/pagedserve-chat
#
# It generates the Go stubs of the public API (protos/pagedserve/v1/*.proto; go_package
# github.com/pagedserve/pagedserve/gen/go/pagedserve/v1) with protoc, protoc-gen-go and
# protoc-gen-go-grpc into a GOPATH under .cache/go, then builds main.go against them and the
# grpc-go, protobuf-go and genproto sources Debian installs in /usr/share/gocode. Nothing is
# fetched (GO111MODULE=off: no module proxy). Go's build cache lives in .cache/go too, so a
# second build takes about a second. PAGEDSERVE_GO_WORK overrides .cache/go.
#
# NOTE: golang-google-grpc-dev accepts either github.com/golang/protobuf 1.3
# (golang-github-golang-protobuf-1-3-dev) or 1.5; grpc-go marshals with it, and 1.3 crashes on
# the messages protoc-gen-go 1.28 writes (a nil dereference on the first oneof). 1.5 is a shim
# over google.golang.org/protobuf; hence the explicit golang-github-golang-protobuf-1-5-dev.
set -euo pipefail

GOCODE=/usr/share/gocode/src
if [ -e "$GOCODE/github.com/golang/protobuf/proto/table_marshal.go" ]; then
  echo "github.com/golang/protobuf 1.3 is installed; grpc-go would crash marshalling this" \
    "example's messages: apt-get install golang-github-golang-protobuf-1-5-dev" >&2
  exit 1
fi

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
WORK=${PAGEDSERVE_GO_WORK:-$ROOT/.cache/go}
OUT=${1:-$WORK/bin/pagedserve-chat}
SRC=$WORK/gopath/src

# NOTE: regenerated on every build, so the stubs always match protos/; an unchanged output
# keeps Go's build cache valid.
rm -rf "$SRC/github.com/pagedserve"
mkdir -p "$SRC" "$(dirname "$OUT")"
protoc -I "$ROOT/protos" --go_out="$SRC" --go-grpc_out="$SRC" \
  pagedserve/v1/common.proto pagedserve/v1/generation.proto

cd "$HERE"
GO111MODULE=off GOPATH="$WORK/gopath:/usr/share/gocode" GOCACHE="$WORK/build-cache" \
  go build -o "$OUT" .
