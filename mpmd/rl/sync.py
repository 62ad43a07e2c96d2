"""Weight sync: a Trainer's parameters, stage slice by stage slice, to a sampler group.

    sync = WeightSync(trainer, groups, "learner", "sampler")
    trainer.step(batch)
    params = sync()         # per stage, a handle on the sampler's slice: this update's parameters

Each stage's parameters leave the slice that updated them and land on the sampler's slice laid
out by the model's rules on the sampler's mesh (mpmd/stages/sharding.py RULES: a tensor-parallel
sampler gets its weights split over `tensor` as a learner slice of that mesh would), over the
data plane, in one call (mpmd/groups/client.py move_all): the controller neither waits for the
step nor carries a byte. The copy is bitwise the learner's (a move is a copy, never a cast).
The previous copy is freed on the sampler once the new one is made, after every call before.
"""

from __future__ import annotations

import numpy as np

from mpmd.groups.client import Groups, Handle
from mpmd.runtime.worker.instructions import Spec
from mpmd.stages import names, sharding


class WeightSync:
    """The learner's parameters to the sampler's slice, on each call."""

    def __init__(self, trainer, groups: Groups, learner, sampler, rules=None):
        self.trainer, self.groups, self.learner, self.sampler = trainer, groups, learner, sampler
        mesh = groups.meshes[groups.slice_of(sampler)]
        rules = sharding.RULES if rules is None else rules
        self.layouts = [sharding.stage_param_layouts(fn, mesh, rules, k) for k, fn in enumerate(trainer.pipeline.fns)]
        self.copies: list[Handle] | None = None

    @property
    def num_bytes(self) -> int:
        """Bytes of parameters one sync moves."""
        return sum(
            int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
            for h in param_handles(self.trainer, self.groups, self.learner)
            for s in h.specs
        )

    def __call__(self) -> list[Handle]:
        """Per stage, a handle on the sampler's slice to the parameters of the last update sent."""
        handles = param_handles(self.trainer, self.groups, self.learner)
        new = self.groups.move_all(handles, self.sampler, self.layouts)
        if self.copies is not None:
            self.groups.delete(*self.copies)
        self.copies = new
        return new


def param_handles(trainer, groups: Groups, group) -> list[Handle]:
    """Per stage, a handle to the trainer's parameters on its slice (the tree `trainer.params()`
    gives for that stage), as they are after every step sent before the next call: a move of
    one sends the parameters of the last update sent, without waiting for it here."""
    g = groups.groups[groups._group(group).name]
    out = []
    for k, fn in enumerate(trainer.pipeline.fns):
        r = g.slices[trainer.placement[k]]
        layouts = trainer.layout.params[k]
        specs = tuple(
            Spec(tuple(s.shape), np.dtype(s.dtype).name, tuple(layout)) for s, layout in zip(fn.param_leaves, layouts)
        )
        out.append(Handle(r, names.params(k), fn.param_tree, specs))
    return out
