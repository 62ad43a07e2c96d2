"""Every name the pipeline gives a buffer, a transfer or a program, built and parsed here.

The runtime knows buffers, transfer keys and programs only by name; the lowering decides
those names and the trainer, checkpoints and dry run read them back. One template per kind
of name, so a new field (a job session, a replica or shard index) is added in one place
and every constructor and parser follows.

Buffers on a slice (k = stage, j = microbatch):
  p{k} o{k}    parameters and optimizer state (persistent)   g{k}  accumulated gradients
  pg{k}        p{k} gathered over fsdp for the step (mesh.fsdp_gather per_step: gather{k})
  st{k}        stage k's state: what its forward changes that is not a parameter (persistent)
  x/{j}        microbatch input (first stage's slice)         t/{j} targets (last stage's slice)
  a{k}/{j}     activation entering stage k                    r{k}/{j} stage k's residuals
  d{k}/{j}     cotangent of stage k's output                  loss/{j} last stage's loss
  kept{k}/{j}  what stage k's input-gradient program (B) leaves for its weight gradient (W)
  out/{j}      last stage's output (prediction plans)
  in{k}/{j}    stage k's side inputs: the batch keys its __call__ takes by keyword
  aux{k}/{j}   the auxiliary losses stage k added (mpmd.add_loss), summed
  wsum         a weighted loss's total weight over the step's microbatches (last stage's slice)
  sq{k}        squared norm of stage k's gradients (when clipping)
  sh{k}        stage k's part of the gradients of shared (tied) parameters
  pk{k}        stage k's state packed, one array per dtype (mpmd/train/packing.py)
  s{g}/pk{k}   in-memory snapshot generation g of pk{k} (mpmd/train/snapshots.py)
  c{g}/pk{k}   the copy a slice holds of its peer's snapshot
Transfer keys name the value, so sender and receiver derive the same key from the plan (the
executor prefixes the run id): act{k}/{j}, grad{k}/{j}, and sq{k}/to{q}, sh{k}/to{q} for a
value sent to several slices (a key is consumed by one receive); s{g}/pk{k} a snapshot to
the peer slice, rpk{k} a peer's copy back to a replaced slice.
Programs: a kind and its stage (fwd3, bwd_w_acc1, update0, pack1), plus a shape suffix @{n} when a
Trainer holds programs for several microbatch shapes at once.

Nothing here imports JAX.
"""

from __future__ import annotations

import re
from typing import NamedTuple

# kind -> template; fields: {k} stage, {j} microbatch, {q} destination stage.
BUFFERS = {
    "params": "p{k}",
    "gathered": "pg{k}",
    "opt_state": "o{k}",
    "stage_state": "st{k}",
    "grads": "g{k}",
    "sqnorm": "sq{k}",
    "shared": "sh{k}",
    "input": "x/{j}",
    "target": "t/{j}",
    "loss": "loss/{j}",
    "output": "out/{j}",
    "side": "in{k}/{j}",
    "aux": "aux{k}/{j}",
    "weight_sum": "wsum",
    "activation": "a{k}/{j}",
    "residuals": "r{k}/{j}",
    "cotangent": "d{k}/{j}",
    "kept": "kept{k}/{j}",
    # The in-memory checkpoint tier (mpmd/train/snapshots.py), generation g in {0, 1}: stage k's
    # state packed, a slice's own snapshot of it, and the copy it holds of its peer's.
    "packed": "pk{k}",
    "snap_packed": "s{g}/pk{k}",
    "peer_packed": "c{g}/pk{k}",
}
KEYS = {
    "act": "act{k}/{j}",
    "grad": "grad{k}/{j}",
    "sqnorm_to": "sq{k}/to{q}",
    "shared_to": "sh{k}/to{q}",
    "snap_packed_to": "s{g}/pk{k}",
    "restore_packed": "rpk{k}",  # to the peer; a peer's copy back
}
# Program kinds, each followed by its stage index. Longest first, so "bwd_w_first" is never
# read as "bwd_w" + something.
PROGRAMS = (
    "init_params",
    "opt_init",
    "fwd",
    "bwd_in",
    "bwd_first",
    "bwd_acc",
    "bwd_w_first",
    "bwd_w_acc",
    "shared_out",
    "shared_in",
    "sqnorm",
    "update",
    "infer",
    "loss",
    "weight",
    "reduce",
    "gather",
    "pack",
    "unpack",
)
STAGE_DIR = "stage_{k}"  # a stage's directory inside a checkpoint step (before leaves were keyed)
# A slice's directory of keyed leaves inside a checkpoint step, named for the generation of
# the control plane that wrote it (runtime/control/client.py, "Generations"); checkpoints from
# before generations have "slice_{r}" alone. The manifest names each leaf's directory.
SLICE_DIR = "slice_{r}.{tag}"


class Name(NamedTuple):
    """A parsed name: its kind and the fields its template has (None where it has none)."""

    kind: str
    stage: int | None = None
    microbatch: int | None = None
    to: int | None = None  # destination stage of a sqnorm_to / shared_to key
    variant: str = ""  # program shape suffix, e.g. "@1"
    generation: int | None = None  # in-memory snapshot generation


def _compile(templates: dict) -> list[tuple[str, re.Pattern]]:
    fields = {
        "{k}": r"(?P<stage>\d+)",
        "{j}": r"(?P<microbatch>\d+)",
        "{q}": r"(?P<to>\d+)",
        "{g}": r"(?P<generation>\d+)",
    }
    out = []
    for kind, template in templates.items():
        pattern = re.escape(template)
        for field, group in fields.items():
            pattern = pattern.replace(re.escape(field), group)
        out.append((kind, re.compile(pattern + r"\Z")))
    return out


_BUFFER_RE = _compile(BUFFERS)
_KEY_RE = _compile(KEYS)
_PROGRAM_RE = re.compile(
    r"(?P<kind>" + "|".join(sorted(PROGRAMS, key=len, reverse=True)) + r")(?P<stage>\d+)(?P<variant>@\d+)?\Z"
)


def _parse(patterns, text: str, what: str) -> Name:
    for kind, pattern in patterns:
        match = pattern.match(text)
        if match:
            fields = {f: int(v) for f, v in match.groupdict().items() if v is not None}
            return Name(kind, **fields)
    raise ValueError(f"{text!r} is not a pipeline {what} name")


def parse_buffer(name: str) -> Name:
    """Name of buffer `name`; ValueError if the lowering never makes such a name."""
    return _parse(_BUFFER_RE, name, "buffer")


def parse_key(key: str) -> Name:
    return _parse(_KEY_RE, key, "transfer key")


def parse_program(name: str) -> Name:
    match = _PROGRAM_RE.match(name)
    if not match:
        raise ValueError(f"{name!r} is not a pipeline program name")
    return Name(match["kind"], stage=int(match["stage"]), variant=match["variant"] or "")


# -- constructors: one per template, so call sites read as what they name ------------------
def params(k: int) -> str:
    return BUFFERS["params"].format(k=k)


def gathered(k: int) -> str:
    return BUFFERS["gathered"].format(k=k)


def opt_state(k: int) -> str:
    return BUFFERS["opt_state"].format(k=k)


def stage_state(k: int) -> str:
    return BUFFERS["stage_state"].format(k=k)


def grads(k: int) -> str:
    return BUFFERS["grads"].format(k=k)


def sqnorm(k: int) -> str:
    return BUFFERS["sqnorm"].format(k=k)


def shared(k: int) -> str:
    return BUFFERS["shared"].format(k=k)


def inputs(j: int) -> str:
    return BUFFERS["input"].format(j=j)


def targets(j: int) -> str:
    return BUFFERS["target"].format(j=j)


def loss(j: int) -> str:
    return BUFFERS["loss"].format(j=j)


def output(j: int) -> str:
    return BUFFERS["output"].format(j=j)


def activation(k: int, j: int) -> str:
    return BUFFERS["activation"].format(k=k, j=j)


def residuals(k: int, j: int) -> str:
    return BUFFERS["residuals"].format(k=k, j=j)


def cotangent(k: int, j: int) -> str:
    return BUFFERS["cotangent"].format(k=k, j=j)


def kept(k: int, j: int) -> str:
    return BUFFERS["kept"].format(k=k, j=j)


def side(k: int, j: int) -> str:
    return BUFFERS["side"].format(k=k, j=j)


def aux(k: int, j: int) -> str:
    return BUFFERS["aux"].format(k=k, j=j)


def weight_sum() -> str:
    return BUFFERS["weight_sum"]


def packed(k: int) -> str:
    return BUFFERS["packed"].format(k=k)


def snapshot(g: int, k: int) -> str:
    return BUFFERS["snap_packed"].format(g=g, k=k)


def peer_copy(g: int, k: int) -> str:
    return BUFFERS["peer_packed"].format(g=g, k=k)


def snapshot_key(g: int, k: int) -> str:
    return KEYS["snap_packed_to"].format(g=g, k=k)


def restore_key(k: int) -> str:
    return KEYS["restore_packed"].format(k=k)


def act_key(k: int, j: int) -> str:
    return KEYS["act"].format(k=k, j=j)


def grad_key(k: int, j: int) -> str:
    return KEYS["grad"].format(k=k, j=j)


def sqnorm_key(k: int, q: int) -> str:
    return KEYS["sqnorm_to"].format(k=k, q=q)


def shared_key(k: int, q: int) -> str:
    return KEYS["shared_to"].format(k=k, q=q)


def program(kind: str, k: int, variant: str = "") -> str:
    assert kind in PROGRAMS, kind
    return f"{kind}{k}{variant}"


def variant(n: int) -> str:
    """Suffix of the n-th set of programs and plans compiled for one microbatch shape."""
    return f"@{n}"


def stage_dir(k: int) -> str:
    return STAGE_DIR.format(k=k)


def slice_dir(r: int, tag: str) -> str:
    """Slice r's directory in a checkpoint step written in generation `tag`."""
    return SLICE_DIR.format(r=r, tag=tag)
