"""The bases of the sections a registration extends (a model family's model.*, a data
source's data.*, a cluster backend's cluster.*), and what every section shares: strict keys,
ConfigError. recipes/config/schema.py assembles them into the Config."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from mpmd.recipes import registry
from mpmd.runtime.wire.verbs import TRANSPORTS


class ConfigError(ValueError):
    """A config the user wrote is invalid; the message names the key and what is allowed."""


INT_LIMIT = 2**63 - 1  # every integer key fits an int64 (shapes, counts, byte sizes, seeds)


class _Section(BaseModel):
    # strict: YAML already gives typed values, so "5" for an int is a mistake, not a coercion.
    # No key takes a NaN or an infinity (YAML's .nan, .inf): null is how a key says "none".
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _ints_fit_int64(cls, values):
        if isinstance(values, dict):
            for key, value in values.items():
                if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT_LIMIT:
                    # recipes/config/loading.py's _describe_error puts the section before the key
                    raise PydanticCustomError("int_too_large", "too large", {"key": key, "value": value})
        return values


class SliceShape(_Section):
    """One slice's mesh: data x fsdp x tensor x expert devices (mpmd.stages.sharding.SliceMesh)."""

    data: int | None = Field(
        None,
        gt=0,
        description="ways a microbatch is split (data parallel); null = the devices "
        "fsdp x tensor x expert leave: max(1, cluster.devices_per_worker // "
        "(fsdp x tensor x expert))",
    )
    fsdp: int = Field(
        1, gt=0, description="ways a microbatch and the parameter dims the rules put on fsdp are split (ZeRO-3)"
    )
    tensor: int = Field(
        1, gt=0, description="ways the parameter dims the rules put on tensor are split (Megatron-style)"
    )
    expert: int = Field(
        1,
        gt=0,
        description="ways a mixture's experts are split (expert parallel: "
        "each device holds num_experts / expert of every MoE "
        "layer's); the dense layers split the microbatch over it",
    )

    def resolved(self, devices_per_worker: int) -> dict[str, int]:
        """{data, fsdp, tensor[, expert]} with data's null replaced (what mpmd.Trainer(mesh=...)
        takes); expert only when above 1, so resolved configs without experts read as before."""
        data = self.data or max(1, devices_per_worker // (self.fsdp * self.expert * self.tensor))
        shape = {"data": data, "fsdp": self.fsdp, "tensor": self.tensor}
        return {**shape, "expert": self.expert} if self.expert > 1 else shape


class ModelSection(_Section):
    """model.*: the keys every family takes; each family's section (its ModelSpec's, in
    recipes/families/) adds its own, and model.kind picks the section."""

    kind: str = Field(
        "gpt",
        description="which model to build (each family's own keys: its section in recipes/families/)",
        json_schema_extra={"one_of": "model"},
    )


class DataSection(_Section):
    """data.*: the keys every source takes. Each registered source (recipes/data/sources.py,
    mpmd.recipes.registry.register_data_source) is a subclass adding its own."""

    source: str = Field(
        "stdlib",
        description="where the training data comes from (each source's own keys: recipes/data/sources.py): "
        "stdlib = this Python's own .py files as bytes, no download; files = data.paths; "
        "synthetic = seeded random data; tokens = a corpus `mpmd tokenize` wrote, through Grain; "
        "jsonl = fine-tuning examples, the loss on response tokens only",
        json_schema_extra={"one_of": "data"},
    )
    tokenizer: str = Field(
        "bytes",
        description="bytes = one token per UTF-8 byte; or a Hugging Face tokenizer.json (or its "
        "directory): model.vocab_size then follows it unless given. The tokens source "
        "uses its corpus's tokenizer (a tokenizer given must be the same)",
    )


class ClusterSection(_Section):
    """cluster.*: the keys every backend takes; each backend's section (its BackendSpec's, in
    recipes/backends/) adds its own, and cluster.backend picks the section."""

    backend: str = Field(
        "local",
        description="where the slices run (each backend's own keys: its section in recipes/backends/): "
        "inprocess = threads; local = processes here; static = by address; "
        "shared = slices leased from a persistent cluster (`mpmd cluster up`)",
        json_schema_extra={"one_of": "cluster"},
    )
    num_workers: int | None = Field(
        None,
        gt=0,
        description="workers; null = num_stages // virtual_stages (+ 1 with rl.algorithm: the sampler's), the only valid one",
    )
    devices_per_worker: int = Field(1, gt=0, description="JAX devices each worker owns")
    processes_per_slice: int = Field(
        1,
        gt=0,
        description="local, static, ray: worker processes (one per host) that together own one slice's "
        "mesh of processes_per_slice x devices_per_worker devices; a lost one is a lost slice",
    )
    step_timeout_s: float | None = Field(
        None,
        gt=0,
        description="abort a step with no progress for this long (a worker is lost); "
        "null = max(60 s, 20 x the median recent step time)",
    )
    # Their rules are mpmd.Recovery's (mpmd/train/options.py), checked by building one.
    on_loss: str = Field(
        "auto",
        description="a lost worker: replace = a new one or stop; shrink = go on with the same stages "
        "on the survivors, back to all slices at a checkpoint once workers can start "
        "again; auto = replace if one comes within replace_timeout_s, else shrink",
        json_schema_extra={"one_of": "on_loss"},
    )
    replace_timeout_s: float = Field(
        60.0, description="how long a replacement worker is waited for (on_loss replace or auto); 0 = one try"
    )
    max_restarts: int = Field(
        3,
        ge=0,
        description="recoveries from lost workers within any restart_window_s seconds before the run "
        "gives up (the message names both keys and the last committed step)",
    )
    restart_window_s: float | None = Field(
        3600.0,
        gt=0,
        description="the window max_restarts counts in: recoveries older than this many seconds "
        "stop counting, so a long run is not charged for them forever; null = the whole run",
    )
    slice_memory_bytes: int | None = Field(
        None,
        description="bytes a layout on fewer slices may hold on one slice (parameters, "
        "gradients, optimizer state, saved activations); null = not checked",
    )

    def recovery(self, on_nonfinite: str = "stop"):
        """The Trainer's mpmd.Recovery record of these keys (and train.on_nonfinite)."""
        from mpmd.train.options import Recovery

        return Recovery(
            on_loss=self.on_loss,
            replace_timeout_s=self.replace_timeout_s,
            max_restarts=self.max_restarts,
            restart_window_s=self.restart_window_s,
            slice_memory_bytes=self.slice_memory_bytes,
            on_nonfinite=on_nonfinite,
        )

    @model_validator(mode="after")
    def _recovery_rules(self):
        _record_rules("cluster", self.recovery)
        return self


class WorkerSection(ClusterSection):
    """cluster.*: what the backends whose slices are worker processes add."""

    token_file: str | None = Field(
        None,
        description="file holding the cluster secret; static needs one, others generate it; "
        "shared with cluster.address: the submit token",
    )
    failure_timeout_s: float | None = Field(
        None,
        gt=0,
        description="a worker silent this long (no heartbeat answered) is declared lost "
        "and replaced, whatever its probes said (probe_timeout_s); null = the cluster's default (5 s)",
    )
    probe_timeout_s: float | None = Field(
        0.3,  # runtime/control/heartbeat.py PROBE_TIMEOUT_S
        gt=0,
        le=60,
        description="a worker whose heartbeat goes unanswered is probed: a new connection, and a ping "
        "acknowledged by gRPC's own threads (a busy worker's answer them), each within this many seconds "
        "(or 3 x the slowest recent connection, if longer); one that fails is hung (stopped, frozen, cut "
        "off) and replaced, in well under a second on a quiet machine (docs/fault-tolerance.md); "
        "null = no probes, failure_timeout_s alone; at 0.3 a stopped worker is found in ~0.6 s",
    )
    tls: str = Field(
        "auto",
        description="mutual TLS on every control channel (docs/security.md): auto = an authority made "
        "for the run (local, ray), the cluster file's certificates (shared), in the clear (static: "
        "give the directory its workers were started with, `mpmd worker --tls DIR`); off = in the "
        "clear (also false); a directory = the certificates there (ca.pem, cert.pem, key.pem; `mpmd cluster certs DIR`)",
    )
    hot_spares: int = Field(
        0,
        ge=0,
        description="workers beyond the slices' kept warm, their programs compiled for any slice "
        "(docs/fault-tolerance.md): a lost slice is taken over by one with nothing to start or "
        "compile, and another is started (local, ray) or warmed (static: the next of "
        "cluster.spares) in the background",
    )
    transport: Literal[TRANSPORTS] = Field(
        "auto",
        description="the data plane between slices: auto = shared memory between workers on one host, "
        "sockets (jax.experimental.transfer) between hosts; socket = sockets always; shm = "
        "shared memory always (not with gangs; a start with workers on two hosts fails)",
    )

    @field_validator("tls", mode="before")
    @classmethod
    def _tls_switch(cls, v):
        # YAML reads `off` and `false` as False (and `on` as True): the switch, not a directory.
        return {False: "off", True: "auto"}.get(v, v) if isinstance(v, bool) else v

    @model_validator(mode="after")
    def _shm_without_gangs(self):
        if self.transport == "shm" and self.processes_per_slice > 1:
            raise ValueError(
                f"cluster.transport=shm cannot serve slices that are gangs (cluster.processes_per_slice="
                f"{self.processes_per_slice}): a gang's pieces travel between its processes' hosts "
                f"over sockets; use auto (shared memory wherever it can) or socket"
            )
        return self


def _known(key: str, name, names) -> str:
    if name not in names:
        raise ValueError(f"{key} must be one of {registry.one_of(names)}, got {name!r}")
    return name


def _record_rules(section: str, make) -> None:
    """Builds the Trainer's option record of a section (its __post_init__ holds the rules);
    its ValueError, naming the field, becomes one naming the key."""
    try:
        make()
    except ValueError as e:
        raise ValueError(f"{section}.{e}") from None
