"""The learner loop, once: the Ray actor, the in-process driver and the overhead benchmark all
drive this object, in this order every inner step::

    adopt()        adopt the merged fragments whose replies arrived and are τ steps old
    batch()        the shard's batch for the current step (a resumed learner repeats none)
    train(batch)   one inner step (the jitted train step) on the learner's params
    record(dt)     count the step: its tokens and seconds, per fragment too
    pushes(epoch)  encode and hand over every fragment that is now due
    paced(dt)      once the step's iteration is over: its pace (``step_time_s``, ξ_step's input)

Time and transport belong to the driver: the Ray actor pads steps and sends pushes through its
emulated WAN link, the in-process driver schedules them on a virtual clock.
"""

from __future__ import annotations

from typing import Any, Callable

from islands.syncer.timing import StepPace

from .core import LearnerCore, PushPlan


class LearnerLoop:
    """Args:
      core: the learner's LearnerCore (parameters, inner state, per-fragment tracks).
      train_step: ``(params, opt_state, batch) -> (params, opt_state, loss)``.
      batch_at: ``step -> batch`` of this learner's shard.
      tokens_per_batch: tokens in one batch (the merge weights and the books).
      num_fragments, sync_every_steps: P and H (which fragment is due when).
    """

    def __init__(self, core: LearnerCore, train_step: Callable, batch_at: Callable[[int], Any],
                 tokens_per_batch: int, num_fragments: int, sync_every_steps: int):
        self.core = core
        self.train_step = train_step
        self.batch_at = batch_at
        self.tokens_per_batch = tokens_per_batch
        self.num_fragments = num_fragments
        self.sync_every_steps = sync_every_steps
        self._next: Any = None   # (step, batch) made ahead by prefetch()
        self.pace = StepPace()   # this incarnation's step time (syncer/timing.py)

    def adopt(self) -> list[int]:
        return self.core.adopt_ready()

    def batch(self) -> Any:
        """The batch of the current step (the one ``prefetch`` made, when it is that step's)."""
        step = self.core.step
        if self._next is not None and self._next[0] == step:
            return self._next[1]
        return self.batch_at(step)

    def prefetch(self, step: int) -> None:
        """Makes the batch of ``step`` now: called while an inner step runs on the device, it
        takes the next batch's host work off the step's path."""
        self._next = (step, self.batch_at(step))

    def train(self, batch: Any) -> Any:
        """One inner step; returns the loss (a device value: ``float()`` waits for the step)."""
        core = self.core
        core.params, core.opt_state, loss = self.train_step(core.params, core.opt_state, batch)
        return loss

    def record(self, step_s: float) -> None:
        self.core.record_step(self.tokens_per_batch, step_s)

    def paced(self, step_s: float) -> None:
        """Counts a finished iteration's seconds (pushes handed over included) in the pace."""
        self.pace.observe(step_s)

    @property
    def step_time_s(self) -> "float | None":
        """The pace both bodies report and read for ξ_step (EMA, first step left out)."""
        return self.pace.step_s

    def pushes(self, epoch: "int | list[int]") -> list[PushPlan]:
        core = self.core
        return [core.make_push(p, epoch)
                for p in core.due(self.num_fragments, self.sync_every_steps)]
