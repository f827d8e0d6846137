"""Asynchronous pipelining with weight prediction (SpecTrain).

A model cut into stages, one per process, trained the PipeDream way: one
forward, one backward, no flush, each stage updating its weights after
every backward, so the pipeline never drains. A batch then meets weights
that later batches have already changed; SpecTrain runs each pass at the
weights predicted for the moment the batch completes, from the
optimizer's smoothed gradient. Modes (:data:`MODES`): ``sync`` (a flush
every batch: single-process training), ``vanilla``, ``stash``
(PipeDream's weight stashing) and ``spectrain``.

* :class:`Stage`: one stage's passes and updates, with no network;
* :class:`StageRunner`: a stage in its own process, neighbours over
  torch.distributed, a replicated stage's gradients through aggnet
  (:class:`AggnetReducer`);
* :func:`emulate`: every stage in one process, bit-identical to the
  distributed run, for experiments;
* :mod:`aggnet.pipeline.schedule`: the passes' order and the version
  differences ``s``; :class:`WeightPredictor`: the prediction (shared with
  the stale-gradient data-parallel mode, :mod:`aggnet.torch.stale`).
"""

from aggnet.pipeline.emulator import run as emulate
from aggnet.pipeline.predict import WeightPredictor
from aggnet.pipeline.runner import AggnetReducer, StageRunner
from aggnet.pipeline.schedule import MODES, paper_versions, stage_order, version_differences
from aggnet.pipeline.stage import Stage

__all__ = ["MODES", "AggnetReducer", "Stage", "StageRunner", "WeightPredictor", "emulate", "paper_versions",
           "stage_order", "version_differences"]
