#!/usr/bin/env bash
# Checks the Go binding (bindings/go) against the library cargo built (release; built
# here when missing): go vet, go test -race, the tests again with cgo's full pointer
# checks (cgocheck2), and the example programs (cmd/example, and cmd/streaming, which
# serves the generative models/tiny_gpt2). Installs Go with apt-get (golang-go) when
# it is missing; the binding needs Go 1.19, Debian 12's version.
#
# The Go programs find the library through links in bindings/go/.lib: libinfer.so for the
# linker and libinfer.so.0, the soname, for the loader (the package's #cgo LDFLAGS put
# that folder in the rpath).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

GO_MIN_MINOR=19 # go1.19

if [[ ! -f "$LIB_DIR/libinfer.so" ]]; then
    command -v cargo >/dev/null || { echo "error: $LIB_DIR/libinfer.so missing and no cargo to build it" >&2; exit 1; }
    cargo build --release
fi
ensure_tool gcc gcc # cgo and the race detector compile C
if ! command -v go >/dev/null; then
    apt_install golang-go
    # Debian installs go under /usr/lib/go-<version>/bin with a link in /usr/bin; be sure.
    command -v go >/dev/null || PATH="$(ls -d /usr/lib/go-*/bin | sort -V | tail -n 1):$PATH"
fi

# Never fetch another toolchain: the go line of go.mod is a minimum, not a pin.
export GOTOOLCHAIN=local CGO_ENABLED=1
if [[ -z "${HOME:-}" && -z "${GOCACHE:-}" ]]; then
    export GOCACHE="${LIB_DIR%/*}/go-cache"
fi

go_version="$(go env GOVERSION)" # e.g. go1.22.2
go_minor="$(sed -E 's/^go1\.([0-9]+).*/\1/' <<<"$go_version")"
if [[ "$go_minor" =~ ^[0-9]+$ ]] && ((go_minor < GO_MIN_MINOR)); then
    echo "error: $go_version is too old for bindings/go (needs go1.$GO_MIN_MINOR or newer)" >&2
    exit 1
fi
echo "-- $go_version, library $LIB_DIR/libinfer.so"

mkdir -p bindings/go/.lib
ln -sf "$LIB_DIR/libinfer.so" bindings/go/.lib/libinfer.so
ln -sf "$LIB_DIR/libinfer.so" bindings/go/.lib/libinfer.so.0

cd bindings/go
echo "-- go vet ./..."
go vet ./...
echo "-- go test -race ./..."
go test -race -count=1 ./...
# cgocheck2 checks every pointer stored into C memory; since go1.21 it is a build-time
# experiment, before that a GODEBUG setting.
if [[ "$go_minor" =~ ^[0-9]+$ ]] && ((go_minor >= 21)); then
    echo "-- GOEXPERIMENT=cgocheck2 go test ./..."
    GOEXPERIMENT=cgocheck2 go test -count=1 ./...
else
    echo "-- GODEBUG=cgocheck=2 go test ./..."
    GODEBUG=cgocheck=2 go test -count=1 ./...
fi
echo "-- go run ./cmd/example"
go run ./cmd/example
echo "-- go run ./cmd/streaming"
go run ./cmd/streaming
echo "Go binding: go vet, go test -race, cgocheck2 and the examples passed ($go_version)"
