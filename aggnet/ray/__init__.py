"""aggnet on Ray: aggregators as Ray actors, and Ray Train through them.

::

    import ray
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer
    from aggnet.ray import Aggregators

    ray.init()
    with Aggregators("racks.toml") as aggs:   # placed by the nodes' aggnet.io/rack labels
        TorchTrainer(train_loop, torch_config=aggs.torch_config(),
                     scaling_config=ScalingConfig(num_workers=8)).fit()

Ray is an optional extra (``pip install 'aggnet[ray]'``); docs/deploy.md
says how to label the nodes and what to watch.
"""

from aggnet.ray.actors import Aggregators
from aggnet.ray.placement import RACK_LABEL, ROOT_LABEL


def __getattr__(name):
    # the Ray Train half imports ray.train (and torch) only when asked for
    if name == "AggnetTorchConfig":
        from aggnet.ray.train import AggnetTorchConfig

        return AggnetTorchConfig
    raise AttributeError(name)


__all__ = ["Aggregators", "AggnetTorchConfig", "RACK_LABEL", "ROOT_LABEL"]
