"""``aggnet k8s render``: every manifest of every example topology valid
against a current Kubernetes release's schemas, the aggregators they start
the ones ``aggnet up`` starts for the same topology (same arguments, same
machines), and mistakes one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (pip install 'aggnet[k8s]')")
kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed (pip install 'aggnet[dev]')")

from aggnet.deploy.k8s import TOPOLOGY_PATH  # noqa: E402
from aggnet.deploy.up import roles, serve_argv  # noqa: E402
from aggnet.protocol import topology  # noqa: E402
from aggnet.protocol.address import parse  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples/topologies").glob("*.toml"))
#: the release the manifests are checked against
K8S_VERSION = "1.33.0"


def _render(path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aggnet", "k8s", "render", "--topology", str(path), *extra],
                          capture_output=True, text=True, timeout=60)


def _objects(out: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(out) if d]


def _workloads(objects):
    return {o["metadata"]["name"]: o for o in objects if o["kind"] in ("Deployment", "DaemonSet")}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_manifest_of_every_example_is_valid_kubernetes(path):
    r = _render(path, "--node", "node-a", "--keys-secret", "aggnet-keys", "--training-job")
    assert r.returncode == 0, r.stderr
    objects = _objects(r.stdout)
    assert objects[0]["kind"] == "Namespace"
    kinds = [o["kind"] for o in objects]
    assert "ConfigMap" in kinds and "PyTorchJob" in kinds
    for obj in objects:
        if obj["kind"] == "PyTorchJob":
            # a Kubeflow resource, not in the core schemas: its pod templates are
            for replica in obj["spec"]["pytorchReplicaSpecs"].values():
                kv.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                             "template": replica["template"]}, K8S_VERSION, strict=True)
            continue
        kv.validate(obj, K8S_VERSION, strict=True)  # raises, naming the field, when one is wrong


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_the_pods_run_what_aggnet_up_starts_on_the_machines_it_starts_it(path):
    topo = topology.load(str(path))
    r = _render(path, "--node", "node-a")
    assert r.returncode == 0, r.stderr
    objects = _objects(r.stdout)
    workloads = _workloads(objects)
    joiners = {name: w for name, w in workloads.items() if name.endswith("-joiner")}
    workloads = {name: w for name, w in workloads.items() if name not in joiners}
    expected = [(role, rack, agg) for role, rack, agg in roles(topo) if agg.kind != "p4"]
    assert len(workloads) == len(expected)
    topo_text = next(o for o in objects if o["kind"] == "ConfigMap")["data"]["topology.toml"]
    assert topology.loads(topo_text, str(path)) == topo  # the pods read the same topology
    for role, rack, agg in expected:
        (w,) = [w for w in workloads.values() if w["spec"]["template"]["metadata"]["labels"]["aggnet.io/role"]
                == role.replace(" ", "-")]
        assert w["kind"] == ("Deployment" if rack is None else "DaemonSet")
        pod = w["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"kubernetes.io/hostname": agg.host or "node-a"}
        assert pod["hostNetwork"] is True
        (c,) = pod["containers"]
        args = c["args"]
        up = serve_argv(topo, rack, agg)
        assert args[:len(up)] == up, (role, args, up)
        # what a pod adds: in-place shard restarts and metrics its node's Prometheus reaches
        assert args[len(up):] == ["--restart", "--metrics-port", "9400", "--metrics-host", "0.0.0.0"]
        assert c["readinessProbe"]["exec"]["command"][:2] == ["aggnet", "stats"]
        assert c["resources"]["requests"]["cpu"] == str(agg.shards or 1)
    # P4 switches are not pods, and the command says how they get their jobs
    p4 = [(role, rack) for role, rack, agg in roles(topo) if agg.kind == "p4"]
    for role, _ in p4:
        assert f"{role}'s P4 switch is not a pod" in r.stderr
    # under a root, a joiner per P4 rack keeps its job joined there for the switch
    under_root = [(role, rack) for role, rack in p4 if topo.parent_of(rack) is not None]
    assert len(joiners) == len(under_root)
    for role, rack in under_root:
        (c,) = joiners[f"{topo.job}-{role.replace(' ', '-')}-joiner"]["spec"]["template"]["spec"]["containers"]
        assert c["args"] == ["switch", "--switch-ip", rack.aggregator.switch_ip or
                             parse(rack.aggregator.address).host, "join-parent", topo.job,
                             "--parent", topo.root.address, "--rack-id", str(rack.index), "--racks",
                             str(len(topo.racks)), "--slots", str(rack.aggregator.slots or 128), "--keep", "2"]
    training = _objects(_render(path, "--node", "node-a", "--training-job").stdout)[-1]
    specs = training["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] + specs.get("Worker", {}).get("replicas", 0) == topo.world
    env = specs["Master"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "AGGNET_TOPOLOGY", "value": TOPOLOGY_PATH} in env


def test_keys_come_from_a_secret_the_aggregators_and_the_workers_mount():
    r = _render(ROOT / "examples/topologies/service-racks.toml", "--keys-secret", "aggnet-keys", "--training-job")
    assert r.returncode == 0, r.stderr
    objects = _objects(r.stdout)
    for w in _workloads(objects).values():
        pod = w["spec"]["template"]["spec"]
        assert {"name": "keys", "secret": {"secretName": "aggnet-keys", "defaultMode": 0o400}} in pod["volumes"]
        args = pod["containers"][0]["args"]
        assert args[args.index("--keys") + 1] == "/etc/aggnet/keys/keys.json"
    env = objects[-1]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "AGGNET_JOB_KEY", "valueFrom": {"secretKeyRef": {"name": "aggnet-keys", "key": "job-key"}}} in env


def test_out_writes_one_file_per_object_numbered_in_the_order_to_apply(tmp_path):
    r = _render(ROOT / "examples/topologies/two-racks.toml", "--out", str(tmp_path / "m"))
    assert r.returncode == 0, r.stderr
    files = sorted(p.name for p in (tmp_path / "m").iterdir())
    assert files[0] == "00-namespace-aggnet.yaml" and files[1].startswith("01-configmap-")
    assert len(files) == 6  # namespace, topology, root and its service, two racks
    for f in files:
        kv.validate(yaml.safe_load((tmp_path / "m" / f).read_text()), K8S_VERSION, strict=True)


@pytest.mark.parametrize("topology_file, extra, says", [
    ("examples/topologies/one-machine.toml", [], "has no host in the topology: give it one"),
    ("no/such.toml", [], "cannot read no/such.toml: No such file or directory"),
])
def test_a_mistake_is_one_line(topology_file, extra, says):
    r = _render(ROOT / topology_file if topology_file.startswith("examples") else Path(topology_file), *extra)
    assert r.returncode == 2
    assert says in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
