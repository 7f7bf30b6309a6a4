"""Imported at the start of every Python process whose PYTHONPATH begins with this folder
(``test_verify_runs_the_trainers_step.py``): a deliberate change to the trainer's step
(``TrainStep.forward_backward`` doubles every gradient it accumulates), so that the test can
show verify's ranks step with it. Nothing changes unless ``HP_TEST_CHANGED_STEP`` is set."""

import os

if os.environ.get("HP_TEST_CHANGED_STEP"):
    from hyper_parallel.runtime import train_step

    _original = train_step.TrainStep.forward_backward

    def _doubled(self, parts):
        total = _original(self, parts)
        for param in self.model.parameters():
            if param.grad is not None:
                param.grad.mul_(2)
        return total

    train_step.TrainStep.forward_backward = _doubled
