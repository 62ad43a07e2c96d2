"""`static`: workers started elsewhere (`mpmd worker --listen HOST:PORT`), given by address.
StaticCluster is the one control plane (runtime/control/client.py) over StaticLauncher."""

from __future__ import annotations

from mpmd.runtime.control.client import ControlPlane
from mpmd.runtime.control.cluster import ReplaceUnsupported
from mpmd.runtime.worker.gang import group_addresses
from mpmd.runtime.worker.main import read_token_file
from mpmd.runtime.wire.tls import cluster_tls


class StaticLauncher:
    """Workers started elsewhere (`mpmd worker --listen HOST:PORT`), given by address. Slices
    take the first addresses; the others are spares, each replacing one lost slice. With no
    spare left, a lost worker that answers again is taken back (readmits)."""

    readmits = True

    def __init__(self, addresses: list[str]):
        self.addresses = addresses
        self._spares: list[str] = []

    def start(self, num_slices: int, root: str | None = None) -> list[str]:
        # root is not ours to set: each worker was started with its own --root, and refuses
        # a checkpoint directory outside it.
        if len(self.addresses) < num_slices:
            raise ValueError(
                f"{num_slices} workers needed (the slices', and hot spares'), got {len(self.addresses)} "
                f"address(es): {self.addresses}"
            )
        self._spares = list(self.addresses[num_slices:])
        return list(self.addresses)

    def replace(self, slot: int, wait_s: float | None = None) -> str:
        if not self._spares:
            raise ReplaceUnsupported(
                f"slice {slot} was lost and StaticCluster has no spare address left "
                f"(give more addresses than slices to allow replacement)"
            )
        return self._spares.pop(0)

    def serves(self, slot: int, slice_index: int) -> None:
        pass  # nothing placed by slice here (Launcher.serves)

    def stop(self) -> None:
        pass  # not ours to stop: the control plane's Shutdown RPC is all they get


class StaticCluster(ControlPlane):
    """Workers started elsewhere with `mpmd worker --listen HOST:PORT --token-file F --root DIR`
    (DIR must hold the run_dir of any Trainer that checkpoints on them).

    A slice served by a gang of processes (runtime/worker/gang.py) is a list of its processes'
    addresses, process 0 first (or cut from a flat list by `processes_per_slice`; None: 1
    for a flat list, the lists' own length otherwise); each
    process was started with `mpmd worker ... --coordinator HOST0:PORT --num-processes k
    --process-id j`, HOST0:PORT a free port on process 0's host.
    The first `num_slices` addresses serve slices; the others are spares that replace a
    lost slice. A token file that its group or others may read is refused unless
    `allow_insecure_token_file` (see read_token_file). `tls`: the directory of certificates
    the workers were started with (`mpmd worker --tls DIR`; `mpmd cluster certs DIR` makes
    them): every channel is then mutual TLS; None: in the clear.
    hot_spares: how many of the addresses after the slices' are kept warm (runtime/control/
    spares.py): a lost slice is taken over by one with nothing to compile, and the next
    address left (a cold spare) is warmed in its place; the addresses must number at least
    the slices plus hot_spares.
    """

    def __init__(
        self,
        addresses,
        *,
        token_file: str | None = None,
        token: str | None = None,
        connect_timeout_s: float = 10.0,
        failure_timeout_s: float = 5.0,
        transfer_host: str | None = None,
        step_timeout_s: float | None = None,
        allow_insecure_token_file: bool = False,
        processes_per_slice: int | None = None,
        transport: str = "auto",
        tls: str | None = None,
        hot_spares: int = 0,
    ):
        addresses = group_addresses(addresses, processes_per_slice)
        tls = cluster_tls(
            tls,
            given_only="a static cluster's workers were started with their certificates (`mpmd worker --tls DIR`): "
            "give tls= that directory (or None: in the clear)",
        )
        if token is None:
            if token_file is None:
                raise ValueError("StaticCluster needs token_file (the file the workers were given) or token")
            token = read_token_file(
                token_file, allow_insecure_token_file, "token_file", "allow_insecure_token_file=True"
            )
        super().__init__(
            StaticLauncher(addresses),
            token,
            connect_timeout_s=connect_timeout_s,
            failure_timeout_s=failure_timeout_s,
            transfer_host=transfer_host,
            step_timeout_s=step_timeout_s,
            transport=transport,
            tls=tls,
            hot_spares=hot_spares,
        )
