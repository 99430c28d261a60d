#!/usr/bin/env bash
# Lint the deployment files: Kubernetes examples, Helm chart, Grafana dashboard,
# Dockerfile. Exits non-zero on the first failing check group (all checks of a
# group are reported before it stops).
#
#   bash .ci/lint-deploy.sh
#
# Needs python3 (>= 3.11 for tomllib) and pip. Installs from PyPI:
# kubernetes-validate, yamllint, jsonschema, promql-parser, dockerfile.
# Helm templates are rendered with `helm` when it is on PATH; otherwise with
# the helm-python-sdk package (Helm's Go engine as a library) unless
# DLX_LINT_HELM_SDK=0; when neither is available the render step is skipped.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
CHART=helm/dlx-proxy
EXAMPLES=deploy/examples
DASHBOARD=dashboards/dlx-proxy.json
SCHEMA=$CHART/values.schema.json
# Oldest Kubernetes with native sidecars on by default (restartPolicy on init
# containers, beta in 1.29); the newest version the validator ships is added below.
K8S_MIN=1.29.0

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
PY=python3

# Check groups started and finished; a failing group stops the script.
STARTED=0
step() { STARTED=$((STARTED + 1)); printf '\n== %s\n' "$*"; }
fail() {
    printf 'FAIL: %s\n' "$*" >&2
    printf 'lint-deploy: %d passed, 1 failed\n' "$((STARTED > 0 ? STARTED - 1 : 0))"
    exit 1
}

step "python tools"
"$PY" - <<'EOF' || fail "python3 >= 3.11 is needed (tomllib)"
import sys
sys.exit(0 if sys.version_info >= (3, 11) else 1)
EOF
"$PY" -m pip install -q kubernetes-validate yamllint jsonschema promql-parser dockerfile
K8S_MAX=$("$PY" -c 'import kubernetes_validate.utils as u; print(u.latest_version())')
echo "kubernetes-validate $("$PY" -m kubernetes_validate --version) (Kubernetes $K8S_MIN and $K8S_MAX)"

# Structural checks in Python: Prometheus operator objects, and config.toml
# files (inside ConfigMaps of YAML files, or plain .toml files).
cat >"$WORK/check_files.py" <<'EOF'
import re, sys, tomllib, yaml

config_rs, files = sys.argv[1], sys.argv[2:]
errors = []

# --- Prometheus operator kinds: the fields the operator needs. ---
def check_rule(doc, where):
    import promql_parser
    groups = (doc.get("spec") or {}).get("groups")
    if not isinstance(groups, list) or not groups:
        errors.append(f"{where}: PrometheusRule needs a non-empty spec.groups")
        return
    for group in groups:
        rules = group.get("rules")
        if not group.get("name") or not isinstance(rules, list) or not rules:
            errors.append(f"{where}: PrometheusRule group needs a name and rules")
            continue
        for rule in rules:
            name = rule.get("alert") or rule.get("record")
            if not name or not rule.get("expr"):
                errors.append(f"{where}: rule {rule} needs alert/record and expr")
                continue
            try:
                promql_parser.parse(str(rule["expr"]))
            except Exception as error:
                errors.append(f"{where}: rule {name}: PromQL does not parse: {error}")
            if "for" in rule and not re.fullmatch(r"[0-9]+(ms|s|m|h|d|w|y)", str(rule["for"])):
                errors.append(f"{where}: rule {name}: bad duration for: {rule['for']}")

def check_monitor(doc, where):
    kind, spec = doc["kind"], doc.get("spec") or {}
    if doc.get("apiVersion") != "monitoring.coreos.com/v1":
        errors.append(f"{where}: {kind} needs apiVersion monitoring.coreos.com/v1")
    if not (doc.get("metadata") or {}).get("name"):
        errors.append(f"{where}: {kind} has no metadata.name")
    if kind == "PrometheusRule":
        check_rule(doc, where)
        return
    if not isinstance(spec.get("selector"), dict):
        errors.append(f"{where}: {kind} needs spec.selector")
    key = {"ServiceMonitor": "endpoints", "PodMonitor": "podMetricsEndpoints"}.get(kind)
    if key is None:
        errors.append(f"{where}: unexpected monitoring.coreos.com kind {kind}")
        return
    endpoints = spec.get(key)
    if not isinstance(endpoints, list) or not endpoints:
        errors.append(f"{where}: {kind} needs a non-empty spec.{key}")
        return
    allowed = {"port", "portNumber", "targetPort", "path", "scheme", "interval", "scrapeTimeout",
               "relabelings", "metricRelabelings", "honorLabels", "honorTimestamps", "params",
               "bearerTokenSecret", "basicAuth", "tlsConfig", "authorization", "oauth2",
               "followRedirects", "enableHttp2", "filterRunning", "proxyUrl", "trackTimestampsStaleness"}
    for i, endpoint in enumerate(endpoints):
        unknown = set(endpoint) - allowed
        if unknown:
            errors.append(f"{where}: {kind} spec.{key}[{i}] has unknown fields {sorted(unknown)}")
        if not (endpoint.get("port") or endpoint.get("portNumber") or endpoint.get("targetPort")):
            errors.append(f"{where}: {kind} spec.{key}[{i}] names no port")

# --- config.toml keys against the structs of src/config/schema.rs (deny_unknown_fields). ---
def load_structs(path):
    try:
        source = open(path).read()
    except OSError:
        return None
    structs = {}
    for match in re.finditer(r"pub struct (\w+)\s*\{(.*?)\n\}", source, re.S):
        fields, rename = {}, None
        for line in match.group(2).splitlines():
            line = line.strip()
            attr = re.match(r'#\[serde\(.*rename\s*=\s*"([^"]+)"', line)
            if attr:
                rename = attr.group(1)
                continue
            field = re.match(r"pub (\w+)\s*:\s*(.+?),?$", line)
            if field:
                fields[rename or field.group(1)] = field.group(2)
                rename = None
        structs[match.group(1)] = fields
    return structs if "Config" in structs else None

structs = load_structs(config_rs)

def check_keys(value, struct, where):
    if not isinstance(value, dict):
        errors.append(f"{where}: expected a table")
        return
    fields = structs[struct]
    for key, inner in value.items():
        if key not in fields:
            errors.append(f"{where}: unknown config key {key!r} (not a field of {struct} in src/config/schema.rs)")
            continue
        ty = fields[key].replace(" ", "")
        vec = re.fullmatch(r"Vec<(\w+)>", ty)
        if ty in structs:
            check_keys(inner, ty, f"{where}.{key}")
        elif vec and vec.group(1) in structs:
            if not isinstance(inner, list):
                errors.append(f"{where}.{key}: expected an array of tables")
                continue
            for i, item in enumerate(inner):
                check_keys(item, vec.group(1), f"{where}.{key}[{i}]")

def check_config(text, where):
    try:
        config = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        errors.append(f"{where}: config.toml does not parse: {error}")
        return
    if structs is not None:
        check_keys(config, "Config", where)

for path in files:
    if path.endswith(".toml"):
        check_config(open(path).read(), path)
        continue
    for n, doc in enumerate(yaml.safe_load_all(open(path))):
        if not doc:
            continue
        where = f"{path}#{n} {doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"
        if str(doc.get("apiVersion", "")).startswith("monitoring.coreos.com/"):
            check_monitor(doc, where)
        if doc.get("kind") == "ConfigMap" and "config.toml" in (doc.get("data") or {}):
            check_config(doc["data"]["config.toml"], where)

if structs is None:
    errors.append("src/config/schema.rs has no Config struct: config keys cannot be checked")
for error in errors:
    print("ERROR", error)
sys.exit(1 if errors else 0)
EOF
check_files() {
    "$PY" "$WORK/check_files.py" "$ROOT/src/config/schema.rs" "$@" || fail "structure or config keys: $*"
}

# Checks shared by the examples and the rendered chart:
#  - kubernetes-validate --strict against $K8S_MIN and $K8S_MAX; it only warns on
#    kinds it has no schema for, so every such warning must be a Prometheus
#    operator kind (monitoring.coreos.com), which gets a structural check here;
#  - every config.toml in a ConfigMap parses and uses only keys src/config/schema.rs knows.
validate_manifests() {
    local out rc=0
    out=$("$PY" -m kubernetes_validate --strict -k "$K8S_MIN" -k "$K8S_MAX" "$@" 2>&1) || rc=$?
    printf '%s\n' "$out" | grep -v '^INFO' || true
    if [ "$rc" -ne 0 ]; then
        fail "kubernetes-validate: $*"
    fi
    if printf '%s\n' "$out" | grep '^WARN' | grep -v 'api version monitoring.coreos.com/v1 ' >/dev/null; then
        fail "kubernetes-validate found kinds without a schema that are not Prometheus operator kinds"
    fi
    echo "note: kubernetes-validate has no schema for monitoring.coreos.com kinds; they are checked structurally"
    check_files "$@"
}

step "yamllint"
yamllint -c .yamllint --strict "$CHART/Chart.yaml" "$CHART/values.yaml" "$EXAMPLES" "$CHART"/ci/*.yaml \
    || fail "yamllint"

step "kubernetes-validate: $EXAMPLES"
example_files=("$EXAMPLES"/*.yaml)
validate_manifests "${example_files[@]}"
echo "ok: ${#example_files[@]} example files"

step "image default config"
check_files deploy/docker/config.toml
echo "ok: deploy/docker/config.toml"

step "JSON syntax"
"$PY" -m json.tool "$DASHBOARD" >/dev/null || fail "$DASHBOARD is not valid JSON"
"$PY" -m json.tool "$SCHEMA" >/dev/null || fail "$SCHEMA is not valid JSON"
echo "ok: $DASHBOARD $SCHEMA"

step "values.yaml against values.schema.json"
"$PY" - "$SCHEMA" "$CHART/values.yaml" "$CHART"/ci/*.yaml <<'EOF' || fail "values do not match the schema"
import json, sys, yaml, jsonschema
schema = json.load(open(sys.argv[1]))
jsonschema.Draft7Validator.check_schema(schema)
validator = jsonschema.Draft7Validator(schema)
defaults = yaml.safe_load(open(sys.argv[2]))

def merged(base, over):
    out = dict(base)
    for key, value in (over or {}).items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out

bad = 0
for path in sys.argv[2:]:
    values = defaults if path == sys.argv[2] else merged(defaults, yaml.safe_load(open(path)))
    for error in sorted(validator.iter_errors(values), key=lambda e: list(e.path)):
        bad += 1
        print(f"ERROR {path}: {'.'.join(map(str, error.path)) or '<root>'}: {error.message}")
    if not bad:
        print(f"ok: {path}")
# The schema must reject what the binary rejects: a misspelt config key.
typo = merged(defaults, {"config": {"dead-letter": {}}})
if validator.is_valid(typo):
    bad += 1
    print("ERROR the schema accepts an unknown config key")
sys.exit(1 if bad else 0)
EOF

step "chart config keys against src/config/schema.rs"
"$PY" - "$ROOT/src/config/schema.rs" "$CHART/values.yaml" <<'EOF' || fail "values.yaml config keys"
import re, sys, yaml
try:
    source = open(sys.argv[1]).read()
except OSError:
    print("ERROR no src/config/schema.rs: the config structs moved; update this check"); sys.exit(1)
structs = {m.group(1): dict(re.findall(r"pub (\w+)\s*:\s*([^,\n]+)", m.group(2)))
           for m in re.finditer(r"pub struct (\w+)\s*\{(.*?)\n\}", source, re.S)}
if "Config" not in structs:
    print("ERROR no Config struct in src/config/schema.rs"); sys.exit(1)
config = yaml.safe_load(open(sys.argv[2]))["config"]
errors = []
for key, value in config.items():
    if key not in structs["Config"]:
        errors.append(f"config.{key} is not a Config field")
    elif isinstance(value, dict):
        struct = structs["Config"][key].strip()
        for inner in value:
            if inner not in structs.get(struct, {}):
                errors.append(f"config.{key}.{inner} is not a field of {struct}")
for error in errors:
    print("ERROR", error)
if not errors:
    print("ok: every config section and key of values.yaml exists in src/config/schema.rs")
sys.exit(1 if errors else 0)
EOF

step "Grafana dashboard"
"$PY" - "$DASHBOARD" <<'EOF' || fail "dashboard"
import json, re, sys, promql_parser
dashboard = json.load(open(sys.argv[1]))
errors = []
if not 36 <= dashboard.get("schemaVersion", 0) <= 41:
    errors.append(f"schemaVersion {dashboard.get('schemaVersion')} is not ~39")
variables = {v["name"]: v for v in dashboard["templating"]["list"]}
if variables.get("DS_PROMETHEUS", {}).get("type") != "datasource":
    errors.append("no datasource variable DS_PROMETHEUS")
for name in ("vhost", "queue"):
    if name not in variables:
        errors.append(f"no template variable {name}")
ids, exprs = set(), 0
def walk(panels):
    global exprs
    for panel in panels:
        if panel["id"] in ids:
            errors.append(f"duplicate panel id {panel['id']}")
        ids.add(panel["id"])
        if panel["type"] != "row" and panel.get("datasource", {}).get("uid") != "${DS_PROMETHEUS}":
            errors.append(f"panel {panel['title']!r} does not use ${{DS_PROMETHEUS}}")
        for target in panel.get("targets", []):
            expr = target["expr"]
            exprs += 1
            concrete = re.sub(r"\$__rate_interval|\$__interval", "5m", expr)
            concrete = re.sub(r"\$\{?(\w+)\}?", "x", concrete)
            try:
                promql_parser.parse(concrete)
            except Exception as error:
                errors.append(f"panel {panel['title']!r}: PromQL does not parse: {error}: {expr}")
            for metric in re.findall(r"\b([a-z_:][a-z0-9_:]*)\{", expr):
                if not metric.startswith("dlx_proxy_"):
                    errors.append(f"panel {panel['title']!r}: unexpected metric {metric}")
        walk(panel.get("panels", []))
walk(dashboard["panels"])
for error in errors:
    print("ERROR", error)
print(f"{'FAILED' if errors else 'ok'}: {len(ids)} panels, {exprs} queries")
sys.exit(1 if errors else 0)
EOF

step "Dockerfile"
"$PY" - Dockerfile <<'EOF' || fail "Dockerfile"
import sys, dockerfile
commands = dockerfile.parse_file(sys.argv[1])
errors = []
froms = [c for c in commands if c.cmd.upper() == "FROM"]
if len(froms) < 2:
    errors.append("not a multi-stage build")
runs = " ".join(" ".join(c.value) for c in commands if c.cmd.upper() == "RUN")
if "cargo build --release --locked" not in runs:
    errors.append("no `cargo build --release --locked`")
final = commands[commands.index(froms[-1]):]
users = [c.value[0] for c in final if c.cmd.upper() == "USER"]
if not users or users[-1].split(":")[0] in ("0", "root"):
    errors.append("the runtime stage does not run as a non-root user")
exposed = {v for c in final if c.cmd.upper() == "EXPOSE" for v in c.value}
if not {"5672", "5671", "15692"} <= exposed:
    errors.append(f"EXPOSE lists {sorted(exposed)}, want 5672 5671 15692")
entry = [c for c in final if c.cmd.upper() == "ENTRYPOINT"]
if not entry or not entry[-1].json or list(entry[-1].value[:2]) != ["dlx-proxy", "run"]:
    errors.append("ENTRYPOINT is not the exec form of `dlx-proxy run ...`")
for error in errors:
    print("ERROR", error)
print(f"{'FAILED' if errors else 'ok'}: {len(commands)} instructions, {len(froms)} stages")
sys.exit(1 if errors else 0)
EOF
for ignored in target/ .git/; do
    grep -qx "$ignored" .dockerignore || fail ".dockerignore does not list $ignored"
done

step "Helm chart"
RENDER=$WORK/rendered
mkdir -p "$RENDER"
value_files=("$CHART/values.yaml" "$CHART"/ci/*.yaml)
if command -v helm >/dev/null 2>&1; then
    echo "helm $(helm version --short)"
    helm lint --strict "$CHART" || fail "helm lint"
    for values in "${value_files[@]}"; do
        name=$(basename "$values" .yaml)
        helm lint --strict "$CHART" -f "$values" >/dev/null || fail "helm lint -f $values"
        helm template demo "$CHART" --namespace lint -f "$values" >"$RENDER/$name.yaml" \
            || fail "helm template -f $values"
    done
    renderer=helm
elif [ "${DLX_LINT_HELM_SDK:-1}" != 0 ] && "$PY" -m pip install -q helm-python-sdk >/dev/null 2>&1; then
    "$PY" - "$CHART" "$RENDER" "${value_files[@]}" <<'EOF' || fail "helm (helm-python-sdk) lint or render"
import os, sys, yaml, helm_python as helm
chart_dir, out_dir, value_files = sys.argv[1], sys.argv[2], sys.argv[3:]
print(f"helm-python-sdk: Helm {helm.helm_sdk_version()}")
failed = False
defaults = yaml.safe_load(open(value_files[0]))
for path in value_files:
    values = yaml.safe_load(open(path)) or {}
    report = helm.lint(chart_dir, values, strict=True)
    for message in report.get("messages", []):
        # severity: 1 info, 2 warning, 3 error
        print(f"lint {path}: [{message['severity']}] {message['path']}: {message['error']}")
        failed |= message["severity"] >= 3
    failed |= bool(report.get("errors"))
    with helm.Chart.load(chart_dir) as chart:
        rendered = chart.render(values, name="demo", namespace="lint", is_install=True)
    name = os.path.splitext(os.path.basename(path))[0]
    with open(os.path.join(out_dir, name + ".yaml"), "w") as out:
        for source in sorted(rendered):
            if source.endswith(".txt") or not rendered[source].strip():
                continue
            out.write(f"---\n# Source: {source}\n{rendered[source]}\n")
sys.exit(1 if failed else 0)
EOF
    renderer=helm-python-sdk
else
    renderer=
    echo "SKIP: neither helm nor helm-python-sdk is available; chart templates not rendered"
fi
if [ -n "$renderer" ]; then
    validate_manifests "$RENDER"/*.yaml
    grep -q 'restartPolicy: Always' "$RENDER/example-sidecar.yaml" \
        || fail "the example sidecar is not a native sidecar"
    grep -q 'restartPolicy: Always' "$RENDER/app-with-sidecar.yaml" \
        || fail "the application Deployment (app.enabled) has no native sidecar"
    grep -q 'kind: Deployment' "$RENDER/app-with-sidecar.yaml" \
        || fail "app.enabled renders no Deployment"
    if grep -n 'subPath' "$RENDER"/*.yaml; then
        fail "rendered manifests use subPath: the config reload never sees subPath mounts change"
    fi
    echo "ok: rendered with $renderer: ${value_files[*]}"
fi

printf '\nlint-deploy: %d passed, 0 failed\n' "$STARTED"
