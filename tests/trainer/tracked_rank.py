"""Rank 0 of a recipe's world on torch's fake process group, its steps under the dry run's
memory tracker, on fake tensors (``fake``) or real ones (``real``): prints the peak by kind
as one JSON line. ``test_dry_run.py`` compares the two (``python -m tests.trainer.tracked_rank
RECIPE fake|real``)."""

import json
import os
import sys

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from hyper_parallel.config import load_training_config
from hyper_parallel.platform.device import FALLBACK_ENV
from hyper_parallel.trainer import dry_run
from hyper_parallel.trainer.base import BaseTrainer


def main(recipe: str, kind: str) -> None:
    config = load_training_config(recipe, [])
    world = config.accelerator.parallel_dims.world_size
    os.environ.update({"RANK": "0", "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "GROUP_RANK": "0", FALLBACK_ENV: "cpu"})
    dry_run._alone(config, 2)
    dry_run._fake_micro_batches(config)  # the same steps in both
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    if kind == "fake":
        figures = dry_run._run_fake(config)["peak_by_kind_bytes"]
    else:
        trainer = BaseTrainer(config, resume=False)
        tracker = dry_run._step_peak_tracker()
        tracker.track_external(trainer.model, trainer.optimizer)
        with dry_run._each_forward_anew(tracker, trainer.model), tracker:
            trainer.train()
        peak = tracker.get_tracker_snapshot("peak")[trainer.device.device]
        figures = {kind.value: size for kind, size in peak.items() if hasattr(kind, "value")}
    dist.destroy_process_group()
    print(json.dumps(figures))


if __name__ == "__main__":
    main(*sys.argv[1:])
