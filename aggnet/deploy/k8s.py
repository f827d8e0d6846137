"""``aggnet k8s render``: a topology's aggregators as Kubernetes objects.

What ``aggnet up`` starts on each machine becomes a workload pinned to that
machine's node, running the same ``aggnet serve`` arguments: a rack's
aggregator (and its fallback) as a DaemonSet on its node, the root as a
Deployment with a Service in front of its control endpoint. Aggregators use
the node's network (``hostNetwork``): the topology's addresses are the
nodes' own, the switch protocol's UDP ports and a service's shard ports are
reached there directly, and no overlay copies a gradient. The topology
travels as a ConfigMap (the training pods read it through
``AGGNET_TOPOLOGY``), job keys as a Secret the operator creates, metrics
are annotated for Prometheus, and the readiness and liveness probes ask the
aggregator itself (``aggnet stats``). P4 switches are not pods: their jobs
are installed by ``aggnet switch`` (or ``aggnet up``) from a machine that
reaches their P4Runtime port. A P4 rack under a root gets a small
Deployment that keeps its job joined at the root on the switch's behalf
(``aggnet switch join-parent --keep``): the root is a Deployment that
Kubernetes restarts, and a restarted root forgets the job.

``--training-job`` adds a Kubeflow Trainer ``PyTorchJob`` that trains the
demo model through aggnet, each rank finding its aggregator in the
topology.
"""

from __future__ import annotations

import os
import sys

from aggnet.deploy.up import probe_address, roles, serve_argv
from aggnet.protocol.address import parse
from aggnet.protocol.topology import Aggregator, Topology, TopologyError, loads

#: where the pods find the topology and the job keys
TOPOLOGY_DIR = "/etc/aggnet/topology"
TOPOLOGY_PATH = f"{TOPOLOGY_DIR}/topology.toml"
KEYS_DIR = "/etc/aggnet/keys"
KEYS_FILE = "keys.json"
#: the Secret's key holding the job's own key, for the training pods
JOB_KEY = "job-key"
#: seconds the probes give the aggregator to answer STATS
PROBE_TIMEOUT = 3
DEFAULT_METRICS_PORT = 9400


def add_arguments(p) -> None:
    p.add_argument("what", choices=["render"], help="render: print the manifests (or write them to --out)")
    p.add_argument("--topology", required=True, help="the topology file (examples/topologies/)")
    p.add_argument("--image", default=None,
                   help="the container image holding aggnet (default aggnet:VERSION; build one from the Dockerfile)")
    p.add_argument("--namespace", default="aggnet", help="the namespace of every object (default %(default)s)")
    p.add_argument("--node", default=None,
                   help="the node of aggregators the topology gives no host (a one-machine topology)")
    p.add_argument("--keys-secret", default=None, metavar="NAME",
                   help=f"a Secret holding the job keys file as {KEYS_FILE} (aggnet job create; every aggregator "
                        f"serves with --keys) and the job's key as {JOB_KEY} (the training pods sign with it)")
    p.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT,
                   help="each aggregator's Prometheus port, on its node (default %(default)s)")
    p.add_argument("--training-job", action="store_true",
                   help="also a Kubeflow Trainer PyTorchJob, one pod per rank of the topology, training the demo "
                        "model through aggnet")
    p.add_argument("--out", default=None, help="write one file per object into this folder instead of printing")


def main(args) -> int:
    try:
        import yaml
    except ImportError:
        print("aggnet k8s: rendering needs PyYAML: pip install 'aggnet[k8s]'", file=sys.stderr)
        return 2
    try:
        with open(args.topology, encoding="utf-8") as f:
            text = f.read()
        topo = loads(text, args.topology)
        objects = render(topo, text, image=args.image, namespace=args.namespace, node=args.node,
                         keys_secret=args.keys_secret, metrics_port=args.metrics_port,
                         training=args.training_job)
    except OSError as exc:
        print(f"aggnet k8s: cannot read {args.topology}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except (TopologyError, ValueError) as exc:
        print(f"aggnet k8s: {exc}", file=sys.stderr)
        return 2
    dumper = _dumper(yaml)
    for role, _, agg in roles(topo):
        if agg.kind == "p4":
            print(f"aggnet k8s: {role}'s P4 switch is not a pod: install its jobs with `aggnet up --topology "
                  f"{args.topology}` from a machine that reaches {agg.p4runtime}", file=sys.stderr)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        for i, obj in enumerate(objects):
            # numbered: kubectl apply -f FOLDER takes files by name, the namespace first
            path = os.path.join(args.out, f"{i:02d}-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml")
            with open(path, "w", encoding="utf-8") as f:
                yaml.dump(obj, f, Dumper=dumper, sort_keys=False)
        print(f"wrote {len(objects)} manifests to {args.out} (kubectl apply -f {args.out})")
    else:
        print(f"# aggnet k8s render --topology {args.topology}: kubectl apply -f this file")
        print(yaml.dump_all(objects, Dumper=dumper, sort_keys=False), end="")
    return 0


def _dumper(yaml):
    """PyYAML's safe dumper, writing a multi-line string (the topology) as
    a block that reads like the file it came from."""

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper, value):
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    Dumper.ignore_aliases = lambda self, data: True  # a probe's command written twice, not as &id001
    return Dumper


def render(topo: Topology, topology_text: str, *, image: str | None = None, namespace: str = "aggnet",
           node: str | None = None, keys_secret: str | None = None, metrics_port: int = DEFAULT_METRICS_PORT,
           training: bool = False) -> list[dict]:
    """The objects, in the order to apply them."""
    from aggnet import __version__

    image = image or f"aggnet:{__version__}"
    job = _name(topo.job)
    objects = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        {"apiVersion": "v1", "kind": "ConfigMap",
         "metadata": {"name": f"{job}-topology", "namespace": namespace, "labels": _labels(job, "topology")},
         "data": {"topology.toml": topology_text}},
    ]
    for role, rack, agg in roles(topo):
        if agg.kind == "p4":
            # a switch, not a pod: aggnet switch (or aggnet up) installs its jobs
            if role.startswith("rack ") and topo.parent_of(rack) is not None:
                objects.append(_joiner(topo, rack, f"{job}-{_name(role)}-joiner", namespace, job, role, image,
                                       keys_secret))
            continue
        argv = serve_argv(topo, rack, agg) + ["--restart", "--metrics-port", str(metrics_port),
                                              "--metrics-host", "0.0.0.0"]
        if keys_secret:
            argv += ["--keys", f"{KEYS_DIR}/{KEYS_FILE}"]
        name = f"{job}-{_name(role)}"
        pod = _pod(job, role, agg, argv, image, _node_of(agg, role, node), keys_secret=keys_secret,
                   metrics_port=metrics_port)
        if rack is None:
            objects += _root(name, namespace, job, agg, pod)
        else:
            objects.append({"apiVersion": "apps/v1", "kind": "DaemonSet",
                            "metadata": {"name": name, "namespace": namespace, "labels": _labels(job, role)},
                            # the default rolling update stops a node's old pod before
                            # its new one starts: the host's ports are free again
                            "spec": {"selector": {"matchLabels": _selector(job, role)}, "template": pod}})
    if training:
        objects.append(training_job(topo, job, namespace, image, keys_secret))
    return objects


#: seconds between a joiner's JOINs at the root
JOIN_EVERY = 2


def _joiner(topo: Topology, rack, name: str, namespace: str, job: str, role: str, image: str,
            keys_secret: str | None) -> dict:
    """The control plane's side of a P4 rack under a root: joins the job at
    the root for the switch, again every JOIN_EVERY seconds."""
    from aggnet.deploy.switches import DEFAULT_SLOTS

    agg, root = rack.aggregator, topo.parent_of(rack)
    args = ["switch", "--switch-ip", agg.switch_ip or parse(agg.address).host, "join-parent", topo.job, "--parent",
            root.address, "--rack-id", str(rack.index), "--racks", str(len(topo.racks)), "--slots",
            str(agg.slots or DEFAULT_SLOTS), "--keep", str(JOIN_EVERY)]
    container = {"name": "joiner", "image": image, "command": ["aggnet"], "args": args,
                 "resources": {"requests": {"cpu": "10m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}}}
    if keys_secret:  # a keyed root takes the JOIN signed with the job's key, as a worker's
        container["env"] = [{"name": "AGGNET_JOB_KEY",
                             "valueFrom": {"secretKeyRef": {"name": keys_secret, "key": JOB_KEY}}}]
    pod = {"metadata": {"labels": _selector(job, f"{role} joiner")},
           "spec": {"terminationGracePeriodSeconds": 5, "containers": [container]}}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": namespace, "labels": _labels(job, f"{role} joiner")},
            "spec": {"replicas": 1, "selector": {"matchLabels": _selector(job, f"{role} joiner")}, "template": pod}}


def _root(name: str, namespace: str, job: str, agg: Aggregator, pod: dict) -> list[dict]:
    a = parse(agg.address)
    protocol = "UDP" if a.scheme == "udp" else "TCP"
    return [
        {"apiVersion": "apps/v1", "kind": "Deployment",
         "metadata": {"name": name, "namespace": namespace, "labels": _labels(job, "root")},
         # one process owns the node's ports: the old one goes before the new one starts
         "spec": {"replicas": 1, "strategy": {"type": "Recreate"},
                  "selector": {"matchLabels": _selector(job, "root")}, "template": pod}},
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": name, "namespace": namespace, "labels": _labels(job, "root")},
         "spec": {"selector": _selector(job, "root"),
                  "ports": [{"name": "control", "port": a.port, "targetPort": a.port, "protocol": protocol}]}},
    ]


def _pod(job: str, role: str, agg: Aggregator, argv: list[str], image: str, node: str, *,
         keys_secret: str | None, metrics_port: int) -> dict:
    a = parse(agg.address)
    ask = ["aggnet", "stats", probe_address(agg), "--timeout", str(PROBE_TIMEOUT)]
    cores = agg.shards or 1
    container = {
        "name": "aggregator", "image": image, "command": ["aggnet"], "args": argv,
        "ports": _ports(agg, a) + [{"name": "metrics", "containerPort": metrics_port, "protocol": "TCP"}],
        # one core per shard: a shard is one busy process
        "resources": {"requests": {"cpu": str(cores), "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
        "readinessProbe": {"exec": {"command": ask}, "periodSeconds": 10, "timeoutSeconds": PROBE_TIMEOUT + 2},
        "livenessProbe": {"exec": {"command": ask}, "initialDelaySeconds": 30, "periodSeconds": 20,
                          "timeoutSeconds": PROBE_TIMEOUT + 2, "failureThreshold": 3},
        "volumeMounts": [{"name": "topology", "mountPath": TOPOLOGY_DIR,
                          "readOnly": True}],
    }
    volumes = [{"name": "topology", "configMap": {"name": f"{job}-topology"}}]
    if keys_secret:
        container["volumeMounts"].append({"name": "keys", "mountPath": KEYS_DIR, "readOnly": True})
        volumes.append({"name": "keys", "secret": {"secretName": keys_secret, "defaultMode": 0o400}})
    return {
        "metadata": {"labels": _selector(job, role),
                     "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(metrics_port),
                                     "prometheus.io/path": "/metrics"}},
        "spec": {"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet",
                 "nodeSelector": {"kubernetes.io/hostname": node},
                 "terminationGracePeriodSeconds": 15, "containers": [container], "volumes": volumes},
    }


def _ports(agg: Aggregator, a) -> list[dict]:
    """The ports the aggregator listens on, where the topology says how many."""
    if a.scheme == "udp":
        return [{"name": f"udp-{i}", "containerPort": a.port + i, "protocol": "UDP"}
                for i in range(agg.shards or 1)]
    ports = [{"name": "control", "containerPort": a.port, "protocol": "TCP"}]
    return ports + [{"name": f"shard-{i}", "containerPort": a.port + 1 + i, "protocol": "TCP"}
                    for i in range(agg.shards or 0)]


def _node_of(agg: Aggregator, role: str, node: str | None) -> str:
    if agg.host is not None:
        return agg.host
    if node is not None:
        return node
    raise ValueError(f"{role}'s aggregator has no host in the topology: give it one (host = \"NODE\") or name "
                     f"the node of such aggregators with --node NODE")


def training_job(topo: Topology, job: str, namespace: str, image: str, keys_secret: str | None) -> dict:
    """A Kubeflow Trainer PyTorchJob of one pod per rank of the topology
    (rank 0 the master): the demo trains with DDP through aggnet, each rank
    finding its rack's aggregator in the topology (``AGGNET_TOPOLOGY``)."""
    workers = topo.world
    env = [{"name": "AGGNET_TOPOLOGY", "value": TOPOLOGY_PATH}]
    mounts = [{"name": "topology", "mountPath": TOPOLOGY_DIR, "readOnly": True}]
    volumes = [{"name": "topology", "configMap": {"name": f"{job}-topology"}}]
    if keys_secret:
        # the workers sign their JOINs with the job's key (not the keys file)
        env.append({"name": "AGGNET_JOB_KEY", "valueFrom": {"secretKeyRef": {"name": keys_secret, "key": JOB_KEY}}})

    def replica(count: int) -> dict:
        return {"replicas": count, "restartPolicy": "OnFailure",
                "template": {"metadata": {"labels": _labels(job, "training")},
                             "spec": {"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet",
                                      "containers": [{"name": "pytorch", "image": image,
                                                      "command": ["python", "-m", "aggnet.demo", "--epochs", "3"],
                                                      "env": env, "volumeMounts": mounts,
                                                      "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}],
                                      "volumes": volumes}}}

    specs = {"Master": replica(1)}
    if workers > 1:
        specs["Worker"] = replica(workers - 1)
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": {"name": f"{job}-training", "namespace": namespace, "labels": _labels(job, "training")},
            "spec": {"pytorchReplicaSpecs": specs}}


def _name(text: str) -> str:
    """A DNS-1123 label from a job or role name."""
    out = "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")
    while "--" in out:
        out = out.replace("--", "-")
    return out[:50] or "aggnet"


def _selector(job: str, role: str) -> dict:
    return {"app.kubernetes.io/name": "aggnet", "app.kubernetes.io/instance": job,
            "aggnet.io/role": _name(role)}


def _labels(job: str, role: str) -> dict:
    return {**_selector(job, role), "app.kubernetes.io/part-of": "aggnet"}


__all__ = ["render", "training_job", "TOPOLOGY_PATH"]
