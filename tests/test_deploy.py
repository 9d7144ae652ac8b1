"""The Kubernetes manifests under deploy/, checked without a cluster.

Each kustomization is rendered with ``kubectl kustomize``: with every kubectl that ``$KUBECTL`` names
(paths separated by ``os.pathsep``), else the one on PATH. The manifests are written for kustomize v2.0.3
(the one inside Debian's kubectl 1.20) and every later one, and all renders must agree. Then:

- every built-in object is validated against the Kubernetes API schemas of the oldest and the newest
  version we support (``kubernetes-validate``, offline, strict: an unknown field is an error), and every
  custom resource against its schema in deploy/schemas/; an object with neither fails;
- the objects are checked against one another (selectors, named ports, probes, grace periods, the proxy's
  clusters and routes) and against the server they run: its flags through its own argument parser, its
  health service name, its metric names, the image's user;
- a real ``cosystream serve``, started with the CPU overlay's flags, shows what the manifests lean on: the
  autoscaler's gauge counts open sessions, and a tokens file in a Secret volume is reloaded when the kubelet
  swaps the volume's symlink.
"""

from __future__ import annotations

import argparse
import base64
import copy
import functools
import inspect
import json
import os
import re
import shutil
import subprocess
import threading
from pathlib import Path

import grpc
import jsonschema
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from referencing import Registry, Resource

from cosystream.app.cli import build_parser
from cosystream.engine.headroom import ADMIT_LOAD
from cosystream.frontend.host import StreamOptions
from cosystream.server.frontend import SERVICE_NAME, FrontendConfig
from cosystream.server.servicer import CosyStreamServicer
from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc
from tests.servers import Served

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
SCHEMAS = DEPLOY / "schemas"
OVERLAYS = ("overlays/cpu", "overlays/gpu")
KUSTOMIZATIONS = tuple(sorted(str(path.parent.relative_to(DEPLOY)) for path in DEPLOY.rglob("kustomization.yaml")))
# The oldest Kubernetes the manifests support (the preStop `sleep` action is on by default from 1.30) and
# the newest whose schemas kubernetes-validate ships.
KUBERNETES_VERSIONS = ("1.30", "1.37")
# What kustomize v2.0.3 reads in a kustomization; it ignores anything else without a word.
KUSTOMIZE_V2_FIELDS = {
    "apiVersion",
    "kind",
    "resources",
    "bases",
    "namespace",
    "namePrefix",
    "nameSuffix",
    "commonLabels",
    "commonAnnotations",
    "patchesStrategicMerge",
    "patchesJson6902",
    "configMapGenerator",
    "secretGenerator",
    "generatorOptions",
    "images",
    "vars",
    "configurations",
    "crds",
}
# After its drain grace, serve waits up to the servicer's final_wait_s for the cut streams' finals, then
# gives the gRPC server 1 s to stop (the frontend's drain, cosystream/server/frontend.py).
DRAIN_STOP_S = inspect.signature(CosyStreamServicer.drain).parameters["final_wait_s"].default + 1.0
GRACE_MARGIN_S = 2.0  # process exit and SIGKILL scheduling after that
COREDNS_TTL_S = 5  # the TTL of a Service's records (CoreDNS's kubernetes plugin, by default)
HTTP_HEALTH_PATH = "/health"  # the HTTP port's health (cosystream/server/http/app.py)
HPA_TARGET_MAX_FILL = 0.8  # the autoscaler's target leaves this much of --max-sessions for the ramp


# -- rendering --------------------------------------------------------------------------------------------


def kubectls() -> list[str]:
    named = [path for path in os.environ.get("KUBECTL", "").split(os.pathsep) if path]
    if named:
        return named
    found = shutil.which("kubectl")
    return [found] if found else []


def _comparable(objects: list[dict]) -> list[str]:
    """Objects as sorted JSON, generated config maps' hash suffixes blanked (each kustomize hashes its own way)."""
    texts = [json.dumps(obj, sort_keys=True) for obj in objects]
    for obj in objects:
        if obj["kind"] == "ConfigMap" and (m := re.fullmatch(r"(.+)-[a-z0-9]{10}", obj["metadata"]["name"])):
            texts = [text.replace(f'"{m.group(0)}"', f'"{m.group(1)}-HASH"') for text in texts]
    return sorted(texts)


@functools.cache
def rendered(directory: str) -> tuple[dict, ...]:
    """``kubectl kustomize deploy/DIRECTORY``: the objects, the same from every kubectl."""
    binaries = kubectls()
    if not binaries:
        pytest.fail("no kubectl to render deploy/ with: install one (Debian: kubernetes-client) or set $KUBECTL")
    renders = []
    for kubectl in binaries:
        done = subprocess.run(
            [kubectl, "kustomize", str(DEPLOY / directory)], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, f"{kubectl} kustomize deploy/{directory} failed:\n{done.stderr}"
        renders.append([obj for obj in yaml.safe_load_all(done.stdout) if obj])
    for kubectl, objects in zip(binaries[1:], renders[1:], strict=True):
        assert _comparable(objects) == _comparable(renders[0]), (
            f"{kubectl} renders deploy/{directory} differently from {binaries[0]}"
        )
    return tuple(renders[0])


def find(objects, kind: str, name: str | None = None) -> list[dict]:
    return [obj for obj in objects if obj["kind"] == kind and name in (None, obj["metadata"]["name"])]


def one(objects, kind: str, name: str) -> dict:
    [obj] = find(objects, kind, name)
    return obj


def container(deployment: dict, name: str) -> dict:
    [found] = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


def pod_labels(deployment: dict) -> dict:
    return deployment["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict, labels: dict) -> bool:
    """A label selector (``matchLabels`` only: the manifests use no expressions) against labels."""
    assert set(selector) <= {"matchLabels"}, selector
    return all(labels.get(key) == value for key, value in selector.get("matchLabels", {}).items())


def container_ports(deployment: dict) -> dict[str, int]:
    return {
        port["name"]: port["containerPort"]
        for c in deployment["spec"]["template"]["spec"]["containers"]
        for port in c.get("ports", [])
    }


def cores(quantity: str | int) -> float:
    """A CPU quantity: ``"4"``, ``4``, ``"3500m"``."""
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def seconds(duration: str) -> float:
    """An Envoy (protobuf JSON) duration: ``"120s"``, ``"0.5s"``."""
    assert re.fullmatch(r"\d+(\.\d+)?s", duration), duration
    return float(duration[:-1])


def pre_stop_s(deployment: dict) -> float:
    """How long the server container's preStop hook keeps a deleted pod serving before SIGTERM."""
    return container(deployment, "cosystream")["lifecycle"]["preStop"]["sleep"]["seconds"]


def serve_args(deployment: dict):
    """The server container's flags, parsed by ``cosystream serve``'s own parser."""
    args = container(deployment, "cosystream")["args"]
    flags = [arg.split("=", 1)[0] for arg in args if arg.startswith("--")]
    assert len(flags) == len(set(flags)), f"a flag given twice (the last would win): {args}"
    parser = build_parser()
    [commands] = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    known = commands.choices["serve"]._option_string_actions
    assert set(flags) <= set(known), f"not serve's flags (spelt out in full): {sorted(set(flags) - set(known))}"
    try:
        return parser.parse_args(["serve", *args])
    except SystemExit:
        pytest.fail(f"cosystream serve refuses the Deployment's args {args} (its error is above)")


# -- schemas ----------------------------------------------------------------------------------------------


@functools.cache
def _schema_registry() -> Registry:
    resources = {path.name: yaml.safe_load(path.read_text()) for path in SCHEMAS.glob("*.schema.yaml")}
    for schema in resources.values():
        jsonschema.Draft202012Validator.check_schema(schema)
    return Registry().with_resources((name, Resource.from_contents(schema)) for name, schema in resources.items())


def _validator(file_name: str) -> jsonschema.Draft202012Validator:
    schema = _schema_registry().contents(file_name)
    return jsonschema.Draft202012Validator(schema, registry=_schema_registry())


@functools.cache
def custom_schemas() -> dict[tuple[str, str], jsonschema.Draft202012Validator]:
    """deploy/schemas/ by the (apiVersion, kind) each one's ``const``s name."""
    found = {}
    for path in SCHEMAS.glob("*.schema.yaml"):
        properties = yaml.safe_load(path.read_text()).get("properties", {})
        if "apiVersion" in properties:
            found[properties["apiVersion"]["const"], properties["kind"]["const"]] = _validator(path.name)
    return found


def schema_problems(obj: dict) -> list[str]:
    """Why ``obj`` does not match its schema (none: it does)."""
    where = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    custom = custom_schemas().get((obj["apiVersion"], obj["kind"]))
    if custom is not None:
        return [f"{where}: {error.json_path}: {error.message}" for error in custom.iter_errors(obj)]
    problems = []
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(step) for step in error.path)
            problems.append(f"{where} against Kubernetes {version}: {path}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError:
            problems.append(
                f"{where}: no schema for {obj['apiVersion']} {obj['kind']} (not Kubernetes {version}'s, "
                "none in deploy/schemas/)"
            )
    return problems


def adapter_rules() -> list[dict]:
    config = yaml.safe_load((DEPLOY / "prometheus-adapter" / "config.yaml").read_text())
    errors = [
        f"{e.json_path}: {e.message}"
        for e in _validator("prometheus-adapter-config.schema.yaml").iter_errors(config)
    ]
    assert not errors, errors
    return config["rules"]


def exported_metrics() -> dict[str, str]:
    """The server's metric names (as scraped: counters with ``_total``) and their types."""
    from cosystream import metrics

    found = {}
    for metric in metrics._metrics().values():
        if isinstance(metric, type):  # (the metric classes are in that namespace too)
            continue
        name = metric._name + ("_total" if metric._type == "counter" else "")
        found[name] = metric._type
    return found


# -- the kustomizations -----------------------------------------------------------------------------------


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_kustomization_uses_only_what_kustomize_2_reads(directory):
    root = DEPLOY / directory
    kustomization = yaml.safe_load((root / "kustomization.yaml").read_text())
    assert set(kustomization) <= KUSTOMIZE_V2_FIELDS, (
        f"kustomize v2.0.3 (kubectl 1.20) ignores {sorted(set(kustomization) - KUSTOMIZE_V2_FIELDS)}"
    )
    for resource in kustomization.get("resources", []):
        assert (root / resource).is_file(), f"{resource}: v2.0.3 takes files in `resources`, folders in `bases`"
    for base in kustomization.get("bases", []):
        assert (root / base / "kustomization.yaml").is_file(), base
    files = [
        *kustomization.get("patchesStrategicMerge", []),
        *(patch["path"] for patch in kustomization.get("patchesJson6902", [])),
        *(file for generator in kustomization.get("configMapGenerator", []) for file in generator["files"]),
    ]
    for file in files:
        path = (root / file).resolve()
        assert path.is_file() and path.is_relative_to(root.resolve()), (
            f"{file}: kustomize reads only files in or below the kustomization's folder"
        )


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_every_rendered_object_matches_its_schema(directory):
    objects = rendered(directory)
    assert objects
    problems = [problem for obj in objects for problem in schema_problems(obj)]
    assert not problems, "\n".join(problems)


def test_the_schemas_catch_a_misspelt_or_missing_field():
    objects = rendered("overlays/cpu")
    monitor = copy.deepcopy(one(objects, "ServiceMonitor", "cosystream"))
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    assert any("intervall" in problem for problem in schema_problems(monitor))

    route = copy.deepcopy(one(rendered("gateway"), "GRPCRoute", "cosystream"))
    del route["spec"]["rules"][0]["backendRefs"][0]["port"]
    assert schema_problems(route)

    deployment = copy.deepcopy(one(objects, "Deployment", "cosystream"))
    container(deployment, "cosystream")["readinessProbe"]["grpc"]["port"] = "grpc"  # named: not for gRPC probes
    assert any("readinessProbe" in problem for problem in schema_problems(deployment))

    unknown = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    assert any("no schema" in problem for problem in schema_problems(unknown))


# -- the server pods --------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_server_pods_run_serve_as_their_probes_ports_and_grace_expect(overlay):
    deployment = one(rendered(overlay), "Deployment", "cosystream")
    pod = deployment["spec"]["template"]["spec"]
    server = container(deployment, "cosystream")
    args = serve_args(deployment)
    ports = container_ports(deployment)

    assert args.host == "0.0.0.0" and args.metrics_host in (None, "0.0.0.0")
    assert ports["grpc"] == args.port and ports["metrics"] == args.metrics_port and ports["http"] == args.http_port
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[kind]["grpc"]["port"] == args.port, kind
    # Ready only when the engine is warm and every frontend listens, as health says for the service.
    assert server["startupProbe"]["grpc"]["service"] == SERVICE_NAME
    assert server["readinessProbe"]["grpc"]["service"] == SERVICE_NAME

    drain_s = args.drain_grace_s if args.drain_grace_s is not None else FrontendConfig().drain_grace_s
    sleep_s = pre_stop_s(deployment)
    needed_s = sleep_s + drain_s + DRAIN_STOP_S + GRACE_MARGIN_S
    assert pod["terminationGracePeriodSeconds"] >= needed_s, (
        f"terminationGracePeriodSeconds {pod['terminationGracePeriodSeconds']} < preStop {sleep_s} + "
        f"--drain-grace-s {drain_s} + {DRAIN_STOP_S} s to stop + {GRACE_MARGIN_S} s"
    )
    liveness = server["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > drain_s + DRAIN_STOP_S, (
        "liveness would give up on a server that is NOT_SERVING because it drains"
    )

    # The image's user, a read-only root, and writable folders where serve and its libraries write.
    uid = int(re.search(r"useradd [^\n]*--uid (\d+)", (ROOT / "Dockerfile").read_text()).group(1))
    assert pod["securityContext"]["runAsUser"] == uid and pod["securityContext"]["runAsNonRoot"]
    security = server["securityContext"]
    assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
    assert security["capabilities"]["drop"] == ["ALL"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounts = server["volumeMounts"]
    env = {var["name"]: var["value"] for var in server["env"]}

    def mount_of(path: str) -> dict:
        [mount] = [m for m in mounts if path == m["mountPath"] or path.startswith(m["mountPath"] + "/")]
        return mount

    for var in ("TMPDIR", "HOME"):
        mount = mount_of(env[var])
        assert "emptyDir" in volumes[mount["name"]] and not mount.get("readOnly"), var
    # The tokens file: in a Secret volume mounted whole (a subPath mount never sees the Secret change).
    tokens = mount_of(args.auth_tokens)
    assert "secret" in volumes[tokens["name"]] and "subPath" not in tokens
    # The resume key: the same Secret in every pod, so a drain's snapshots are resumed by another one.
    key = mount_of(args.resume_key_file)
    assert volumes[key["name"]]["secret"]["secretName"] == "cosystream-resume-key" and key.get("readOnly")

    # Whole cores for the engine and each frontend; requests = limits (Guaranteed QoS).
    resources = server["resources"]
    assert resources["requests"]["cpu"] == resources["limits"]["cpu"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"]
    assert cores(resources["limits"]["cpu"]) >= args.frontends + 1
    assert deployment["spec"].get("replicas") is None, "the HorizontalPodAutoscaler owns the replica count"


def test_the_gpu_overlay_gives_each_pod_one_gpu_and_the_cuda_image():
    deployment = one(rendered("overlays/gpu"), "Deployment", "cosystream")
    pod = deployment["spec"]["template"]["spec"]
    server = container(deployment, "cosystream")
    assert server["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert serve_args(deployment).device == "cuda"
    assert server["image"] == "cosystream:latest"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]


def test_the_cpu_overlay_asks_for_no_gpu_and_runs_the_cpu_image():
    deployment = one(rendered("overlays/cpu"), "Deployment", "cosystream")
    server = container(deployment, "cosystream")
    assert not any("gpu" in key for key in server["resources"]["limits"])
    assert serve_args(deployment).device == "cpu"
    assert server["image"] == "cosystream:cpu"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_budgets_policies_and_the_scrape_select_what_they_name(overlay):
    objects = rendered(overlay)
    deployments = find(objects, "Deployment")
    namespace = {obj["metadata"].get("namespace") for obj in objects if obj["kind"] != "Namespace"}
    assert namespace == {"cosystream"}

    def selected(selector: dict) -> dict:
        [deployment] = [d for d in deployments if selects(selector, pod_labels(d))]
        return deployment

    for service in find(objects, "Service"):
        deployment = selected({"matchLabels": service["spec"]["selector"]})
        ports = container_ports(deployment)
        for port in service["spec"]["ports"]:
            target = port["targetPort"]
            assert target in ports or target in ports.values(), (service["metadata"]["name"], port)
    headless = one(objects, "Service", "cosystream-headless")
    assert headless["spec"]["clusterIP"] == "None" and not headless["spec"].get("publishNotReadyAddresses")

    server = one(objects, "Deployment", "cosystream")
    for budget in find(objects, "PodDisruptionBudget"):
        selected(budget["spec"]["selector"])
    assert one(objects, "PodDisruptionBudget", "cosystream")["spec"]["maxUnavailable"] == 1

    for policy in find(objects, "NetworkPolicy"):
        deployment = selected(policy["spec"]["podSelector"])
        ports = container_ports(deployment)
        for rule in policy["spec"]["ingress"]:
            for port in rule["ports"]:
                assert port["port"] in ports, (policy["metadata"]["name"], port)
            for peer in rule.get("from", []):
                if "namespaceSelector" not in peer:  # a pod of this namespace: one of ours
                    selected(peer["podSelector"])
    server_policy = one(objects, "NetworkPolicy", "cosystream")
    [metrics_rule] = [
        r for r in server_policy["spec"]["ingress"] if {"port": "metrics", "protocol": "TCP"} in r["ports"]
    ]
    assert metrics_rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert metrics_rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]

    monitor = one(objects, "ServiceMonitor", "cosystream")
    [scraped] = [
        s for s in find(objects, "Service") if selects(monitor["spec"]["selector"], s["metadata"]["labels"])
    ]
    assert selected({"matchLabels": scraped["spec"]["selector"]}) is server
    service_ports = {port["name"] for port in scraped["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in service_ports

    hpa = one(objects, "HorizontalPodAutoscaler", "cosystream")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "cosystream"}
    assert hpa["spec"]["minReplicas"] >= 2, "with one replica, every disruption takes the whole service down"


# -- autoscaling ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_autoscaler_scales_on_a_gauge_the_server_exports(overlay):
    objects = rendered(overlay)
    hpa = one(objects, "HorizontalPodAutoscaler", "cosystream")
    metrics = {metric["pods"]["metric"]["name"]: metric for metric in hpa["spec"]["metrics"]}
    assert set(metrics) == {"cosystream_active_sessions", "cosystream_engine_load"}
    exported = exported_metrics()
    for name, metric in metrics.items():
        assert metric["type"] == "Pods"
        [rule] = [rule for rule in adapter_rules() if rule["name"]["as"] == name]
        series = re.match(r"'?([a-zA-Z_:][a-zA-Z0-9_:]*)", rule["seriesQuery"]).group(1)
        assert re.search(rule["name"]["matches"], series)
        assert exported.get(series) == "gauge", (
            f"{series}: not a gauge of cosystream/metrics.py ({sorted(exported)})"
        )
        assert "rate(" not in rule["metricsQuery"], "a gauge is summed (or its maximum taken), not rated"
        # The adapter maps the series onto pods through the scrape's target labels.
        assert {"namespace", "pod"} <= set(rule["resources"]["overrides"])

    args = serve_args(one(objects, "Deployment", "cosystream"))
    target = float(metrics["cosystream_active_sessions"]["pods"]["target"]["averageValue"])
    assert 0 < target <= HPA_TARGET_MAX_FILL * args.max_sessions, (
        f"target {target} sessions per pod leaves no room below --max-sessions {args.max_sessions} for the ramp"
    )
    load = float(metrics["cosystream_engine_load"]["pods"]["target"]["averageValue"])
    admit_load = (args.admit_load if args.admit_load is not None else ADMIT_LOAD) or 1.0  # (0: off, overload at 1)
    assert 0 < load < admit_load, f"a load target of {load} is past --admit-load {admit_load}: pods refuse first"


def test_the_helm_values_carry_the_adapter_rules_of_the_config_file():
    values = yaml.safe_load((DEPLOY / "prometheus-adapter" / "values.yaml").read_text())
    assert values["rules"]["custom"] == adapter_rules()
    [config_map] = find(rendered("prometheus-adapter"), "ConfigMap")
    assert yaml.safe_load(config_map["data"]["config.yaml"])["rules"] == adapter_rules()


# -- the proxy --------------------------------------------------------------------------------------------


def envoy_parts(objects) -> tuple[dict, dict, dict]:
    """The Envoy Deployment, its bootstrap config, and the config map that holds it (and the SDS file)."""
    deployment = one(objects, "Deployment", "cosystream-envoy")
    envoy = container(deployment, "envoy")
    args = envoy["args"]
    config_path = args[args.index("--config-path") + 1]
    [mount] = [m for m in envoy["volumeMounts"] if config_path.startswith(m["mountPath"] + "/")]
    [volume] = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    config_map = one(objects, "ConfigMap", volume["configMap"]["name"])
    config = yaml.safe_load(config_map["data"][config_path.rsplit("/", 1)[1]])
    return deployment, config, config_map


def http_connection_managers(config: dict):
    for listener in config["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for network_filter in chain["filters"]:
                if network_filter["name"] == "envoy.filters.network.http_connection_manager":
                    yield listener, chain, network_filter["typed_config"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_proxy_sends_each_stream_to_a_ready_server_with_no_timeout_cutting_it(overlay):
    objects = rendered(overlay)
    deployment, config, config_map = envoy_parts(objects)
    envoy = container(deployment, "envoy")
    server = one(objects, "Deployment", "cosystream")
    args = serve_args(server)
    clusters = {cluster["name"]: cluster for cluster in config["static_resources"]["clusters"]}
    envoy_ports = container_ports(deployment)
    idle_s = args.idle_timeout_s if args.idle_timeout_s is not None else StreamOptions().idle_timeout_s

    for listener, _, manager in http_connection_managers(config):
        port = listener["address"]["socket_address"]["port_value"]
        assert port in envoy_ports.values(), f"listener {listener['name']} on {port}: no such container port"
        routes = [r for host in manager["route_config"]["virtual_hosts"] for r in host["routes"]]
        for route in routes:
            if "route" not in route:
                continue
            assert route["route"]["cluster"] in clusters, route
            assert seconds(route["route"]["timeout"]) == 0, "a route timeout would cut long streams"
        if any("route" in route for route in routes):
            assert seconds(manager["request_timeout"]) == 0
            assert seconds(manager["stream_idle_timeout"]) > idle_s, (
                "the server's idle timeout (a final, then DEADLINE_EXCEEDED) must end an idle stream first"
            )
    for service in find(objects, "Service", "cosystream-envoy"):
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in envoy_ports

    headless = one(objects, "Service", "cosystream-headless")
    address = f"{headless['metadata']['name']}.{headless['metadata']['namespace']}.svc.cluster.local"
    service_ports = {port["port"]: port["targetPort"] for port in headless["spec"]["ports"]}
    server_ports = container_ports(server)
    hpa = one(objects, "HorizontalPodAutoscaler", "cosystream")
    for cluster in clusters.values():
        assert cluster["type"] == "STRICT_DNS" and cluster["lb_policy"] == "LEAST_REQUEST"
        [endpoint] = [e for group in cluster["load_assignment"]["endpoints"] for e in group["lb_endpoints"]]
        socket = endpoint["endpoint"]["address"]["socket_address"]
        assert socket["address"] == address
        assert socket["port_value"] in service_ports
        assert server_ports[service_ports[socket["port_value"]]] == socket["port_value"]
        # One proxy may carry every stream of the largest fleet.
        [thresholds] = cluster["circuit_breakers"]["thresholds"]
        assert thresholds["max_requests"] >= hpa["spec"]["maxReplicas"] * args.max_sessions
        # Out of the rotation within seconds of NOT_SERVING, and never in panic mode (which would send
        # streams to servers that refuse them); a pod gone from DNS leaves at once.
        [check] = cluster["health_checks"]
        assert cluster["ignore_health_on_host_removal"]
        assert cluster["common_lb_config"]["healthy_panic_threshold"]["value"] == 0
        # A deleted pod leaves the headless Service's records at once; the proxy sees it within the DNS
        # cache's TTL and its refresh, while the pod still serves (its preStop sleep).
        assert COREDNS_TTL_S + seconds(cluster["dns_refresh_rate"]) <= pre_stop_s(server)
    grpc_cluster = clusters["cosystream_grpc"]
    assert (
        grpc_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
            "socket_address"
        ]["port_value"]
        == args.port
    )
    protocol = grpc_cluster["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    assert "http2_protocol_options" in protocol["explicit_http_config"]
    [check] = grpc_cluster["health_checks"]
    assert check["grpc_health_check"]["service_name"] == SERVICE_NAME
    [check] = clusters["cosystream_http"]["health_checks"]
    assert check["http_health_check"]["path"] == HTTP_HEALTH_PATH  # (answered live: see below)

    # TLS: every listener's certificate is the SDS file's, read from the TLS Secret's volume.
    sds = yaml.safe_load(config_map["data"]["sds.yaml"])
    secrets = {resource["name"]: resource for resource in sds["resources"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    [tls_mount] = [m for m in envoy["volumeMounts"] if "secret" in volumes[m["name"]]]
    for _, chain, _ in http_connection_managers(config):
        if "transport_socket" not in chain:
            continue
        context = chain["transport_socket"]["typed_config"]["common_tls_context"]
        for sds_config in context["tls_certificate_sds_secret_configs"]:
            certificate = secrets[sds_config["name"]]["tls_certificate"]
            sds_path = sds_config["sds_config"]["path_config_source"]["path"]
            assert sds_path.rsplit("/", 1)[1] in config_map["data"]
            for key in ("certificate_chain", "private_key"):
                assert certificate[key]["filename"].startswith(tls_mount["mountPath"] + "/")
            assert certificate["watched_directory"]["path"] == tls_mount["mountPath"]

    # Termination: the preStop hook drains through the admin port (loopback only), within the grace.
    admin = config["admin"]["address"]["socket_address"]
    assert admin["address"] == "127.0.0.1"
    pre_stop = " ".join(envoy["lifecycle"]["preStop"]["exec"]["command"])
    assert f"/dev/tcp/127.0.0.1/{admin['port_value']}" in pre_stop and "drain_listeners?graceful" in pre_stop
    drain_time_s = float(envoy["args"][envoy["args"].index("--drain-time-s") + 1])
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= drain_time_s + GRACE_MARGIN_S


def test_the_envoy_config_parses_as_the_envoy_v3_api():
    """Strict: an unknown field, a bad duration or enum value fails, as Envoy's own parser would."""
    pytest.importorskip("envoy_data_plane", reason="envoy-data-plane (the Envoy v3 API in Python) not installed")
    # The typed_config messages, registered for Any by importing their modules.
    import envoy_data_plane.envoy.extensions.filters.http.health_check.v3
    import envoy_data_plane.envoy.extensions.filters.http.router.v3
    import envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3
    import envoy_data_plane.envoy.extensions.retry.host.previous_hosts.v3
    import envoy_data_plane.envoy.extensions.upstreams.http.v3  # noqa: F401
    from envoy_data_plane.envoy.config.bootstrap.v3 import Bootstrap
    from envoy_data_plane.envoy.extensions.transport_sockets.tls.v3 import Secret

    _, config, config_map = envoy_parts(rendered("overlays/cpu"))
    bootstrap = Bootstrap.from_dict(config, ignore_unknown_fields=False)
    assert len(bootstrap.static_resources.listeners) == len(config["static_resources"]["listeners"])
    for resource in yaml.safe_load(config_map["data"]["sds.yaml"])["resources"]:
        Secret.from_dict({k: v for k, v in resource.items() if k != "@type"}, ignore_unknown_fields=False)
    broken = copy.deepcopy(config)
    broken["static_resources"]["clusters"][0]["lb_policy"] = "LEAST_REQUESTS"
    with pytest.raises(ValueError):
        Bootstrap.from_dict(broken, ignore_unknown_fields=False)


def test_the_gateway_routes_reach_the_servers_ports():
    gateway_objects = rendered("gateway")
    objects = rendered("overlays/cpu")
    gateway = one(gateway_objects, "Gateway", "cosystream")
    listeners = {listener["name"]: listener for listener in gateway["spec"]["listeners"]}
    envoy_tls = {
        v["secret"]["secretName"]
        for v in one(objects, "Deployment", "cosystream-envoy")["spec"]["template"]["spec"]["volumes"]
        if "secret" in v
    }
    for listener in listeners.values():
        assert {ref["name"] for ref in listener["tls"]["certificateRefs"]} == envoy_tls  # one Secret, both ways
    services = {s["metadata"]["name"]: s for s in find(objects, "Service")}
    for kind in ("GRPCRoute", "HTTPRoute"):
        route = one(gateway_objects, kind, "cosystream")
        for parent in route["spec"]["parentRefs"]:
            assert parent["name"] == gateway["metadata"]["name"]
            assert {"kind": kind} in listeners[parent["sectionName"]]["allowedRoutes"]["kinds"]
        for rule in route["spec"]["rules"]:
            for backend in rule["backendRefs"]:
                [port] = [p for p in services[backend["name"]]["spec"]["ports"] if p["port"] == backend["port"]]
                if kind == "GRPCRoute":
                    assert port["appProtocol"] == "kubernetes.io/h2c"  # the proxies speak HTTP/2 to the pods
    server = one(objects, "Deployment", "cosystream")
    policy = one(gateway_objects, "NetworkPolicy", "cosystream-gateway")
    assert selects(policy["spec"]["podSelector"], pod_labels(server))
    for rule in policy["spec"]["ingress"]:
        for port in rule["ports"]:
            assert port["port"] in container_ports(server)


# -- a live server with the manifests' flags ---------------------------------------------------------------


TOKEN_BEFORE = "before-rotation-0123456789abcdef"
TOKEN_AFTER = "after-rotation-fedcba9876543210"


def write_secret_volume(folder: Path, files: dict[str, str], generation: int) -> None:
    """Lay out ``files`` as the kubelet does a Secret volume: a timestamped folder, the ``..data`` symlink
    to it (replaced by a rename: atomic), and one symlink per key through ``..data``."""
    payload = folder / f"..2026_12_01_00_00_0{generation}.{generation:09d}"
    payload.mkdir()
    for name, text in files.items():
        (payload / name).write_text(text)
    staged = folder / "..data_tmp"
    staged.symlink_to(payload.name)
    staged.rename(folder / "..data")
    for name in files:
        if not (folder / name).is_symlink():
            (folder / name).symlink_to(f"..data/{name}")
    for old in folder.glob("..2026_*"):
        if old != payload:
            shutil.rmtree(old)


@pytest.fixture(scope="module")
def served_as_in_the_pod(tmp_path_factory):
    """``cosystream serve`` with the CPU overlay's flags, the tokens file in a Secret-like volume; ports,
    frontends and the tokens path are this machine's."""
    secret = tmp_path_factory.mktemp("tokens")
    write_secret_volume(secret, {"tokens": f"operator {TOKEN_BEFORE}\n"}, generation=1)
    resume = tmp_path_factory.mktemp("resume")
    write_secret_volume(resume, {"key": base64.b64encode(os.urandom(32)).decode() + "\n"}, generation=1)
    local = (
        "--host",
        "--port",
        "--metrics-port",
        "--http-port",
        "--frontends",
        "--auth-tokens",
        "--resume-key-file",
    )
    args = container(one(rendered("overlays/cpu"), "Deployment", "cosystream"), "cosystream")["args"]
    kept = [arg for arg in args if arg.split("=", 1)[0] not in local]
    assert any(arg.startswith("--resume-key-file=") for arg in args), args
    paths = ("--auth-tokens", str(secret / "tokens"), "--resume-key-file", str(resume / "key"))
    with Served(*kept, "--frontends", "1", *paths) as server:
        serving = health_pb2.HealthCheckResponse.SERVING
        server.wait(lambda: server.health() == serving, 60, "SERVING")
        yield server, secret


def info_with(server: Served, token: str) -> grpc.StatusCode:
    with grpc.insecure_channel(server.address) as channel:
        try:
            pb_grpc.CosyStreamStub(channel).GetServerInfo(
                pb.GetServerInfoRequest(), metadata=[("authorization", f"Bearer {token}")], timeout=10
            )
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


class _OpenStream:
    """A stream holding a session open (silence every 50 ms) until closed."""

    def __init__(self, server: Served, priority: int):
        self.release = threading.Event()
        self.channel = grpc.insecure_channel(server.address)
        config = pb.StreamingConfig(encoding=pb.LINEAR16, sample_rate_hz=16000, priority=priority)
        self.call = pb_grpc.CosyStreamStub(self.channel).StreamingRecognize(
            self._requests(config), metadata=[("authorization", f"Bearer {TOKEN_BEFORE}")], timeout=60
        )
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _requests(self, config):
        yield pb.StreamingRecognizeRequest(config=config)
        while not self.release.wait(0.05):
            yield pb.StreamingRecognizeRequest(audio=b"\0" * 1600)

    def _drain(self):
        try:
            for _ in self.call:
                pass
        except grpc.RpcError:
            pass

    def close(self):
        self.release.set()
        self.thread.join(30)
        self.channel.close()


def test_the_autoscaler_gauge_counts_the_open_sessions_of_a_live_server(served_as_in_the_pod):
    server, _ = served_as_in_the_pod
    import urllib.request

    series = {
        rule["name"]["as"]: re.match(r"'?([a-zA-Z_:][a-zA-Z0-9_:]*)", rule["seriesQuery"]).group(1)
        for rule in adapter_rules()
    }
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()

    def labels(name: str) -> set:
        return {frozenset(re.findall(r'(\w+)="', m)) for m in re.findall(rf"^{name}{{([^}}]*)}}", text, re.M)}

    for name in series.values():
        assert f"# TYPE {name} gauge" in text
    # The sessions rule sums the priorities per pod; the load rule takes the pod's most loaded engine.
    assert labels(series["cosystream_engine_load"]) == {frozenset({"engine"})}
    series = series["cosystream_active_sessions"]
    assert labels(series) == {frozenset({"priority"})}
    assert server.metric(series) == 0
    streams = [_OpenStream(server, pb.REALTIME), _OpenStream(server, pb.BATCH)]
    try:
        server.wait(lambda: server.metric(series) == 2, 30, "two open sessions counted")
    finally:
        for stream in streams:
            stream.close()
    server.wait(lambda: server.metric(series) == 0, 30, "closed sessions uncounted")


def test_a_secret_volume_update_reloads_the_tokens_without_a_restart(served_as_in_the_pod):
    server, secret = served_as_in_the_pod
    pids = server.pids()
    assert info_with(server, TOKEN_BEFORE) == grpc.StatusCode.OK
    assert info_with(server, TOKEN_AFTER) == grpc.StatusCode.UNAUTHENTICATED
    write_secret_volume(secret, {"tokens": f"operator {TOKEN_AFTER}\n"}, generation=2)
    server.wait(lambda: info_with(server, TOKEN_AFTER) == grpc.StatusCode.OK, 15, "the new token accepted")
    assert info_with(server, TOKEN_BEFORE) == grpc.StatusCode.UNAUTHENTICATED
    assert server.pids() == pids, "the server restarted"
    assert (secret / "tokens").resolve().parent.name.endswith("000000002")


def test_the_probes_and_the_proxy_checks_are_answered_by_a_live_server(served_as_in_the_pod):
    server, _ = served_as_in_the_pod
    import urllib.request

    _, config, _ = envoy_parts(rendered("overlays/cpu"))
    probe = container(one(rendered("overlays/cpu"), "Deployment", "cosystream"), "cosystream")["readinessProbe"]
    clusters = {cluster["name"]: cluster for cluster in config["static_resources"]["clusters"]}
    with grpc.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in (
            probe["grpc"]["service"],
            clusters["cosystream_grpc"]["health_checks"][0]["grpc_health_check"]["service_name"],
            "",
        ):
            status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING, service
    path = clusters["cosystream_http"]["health_checks"][0]["http_health_check"]["path"]
    with urllib.request.urlopen(server.http_url + path, timeout=10) as response:  # no token needed
        assert response.status == 200
