"""A worker's cache of loaded programs, shared by every session (job) it serves.

Loading an exported program means deserializing it, checking its custom calls and binding
it to the slice's devices (runtime/worker/programs.py load: a `jax.jit` of the exported call);
its first call compiles it, seconds for a real stage, and the jit object keeps the
executable for every later call with the same argument types and layouts. Every job that
ships the same model would pay both again. The cache keeps the loaded program itself,
keyed by what determines its compiled code, sha256 of (kind, serialized bytes, the mesh's
axis names and sizes, its device ids): a second job (or the same job after a re-Setup)
loading the same bytes onto the same devices gets the same jit object back, a hit, and its
first step runs the executable the first job compiled. A program holds no job's data (its
inputs come from the caller's session), so sharing it between jobs leaks nothing, and one
executable gives the same bits whichever job runs it. (Compiling at load instead, ahead of
time, would not help: an AOT-compiled executable is not the one a jit call looks up.)

The bound is on the serialized bytes of the programs held (`limit_bytes`; a compiled CPU
executable is of the same order), least recently used first out. A program larger than the
bound is still loaded and returned, just not kept. Synthetic "sleep" programs compile
nothing and are not cached.
"""

from __future__ import annotations

import collections
import hashlib
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not imported here: runtime/worker/main.py reads DEFAULT_LIMIT_MB before JAX may load
    import jax

    from mpmd.runtime.worker import programs as programs_lib

DEFAULT_LIMIT_MB = 1024
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT
_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # a load from the persistent cache, within the above
_compiled = threading.local()  # .n: executables acquired on this thread; .hits: of them, disk loads
_listening = False
_counting = threading.Lock()


def backend_compiles() -> int:
    """How many executables XLA has built on the calling thread: JAX's own event for each
    backend compile, which it records on the thread that compiles (a jit compiles where it is
    called), counted by a listener registered on the first call, so callers compare two
    readings. Per thread, so a run counts its own compiles and not those of a thread beside
    it (Orbax's writer slicing arrays for a save). A load from JAX's persistent disk cache
    counts too (JAX times the load as it times a compile): that is a cost a program already
    in this cache (warm) does not pay; persistent_loads() tells how many of them it was."""
    _listen()
    return getattr(_compiled, "n", 0)


def persistent_loads() -> int:
    """How many of backend_compiles() on the calling thread were loads from JAX's persistent
    compilation cache (its own cache-hit event), not compiles: compare two readings."""
    _listen()
    return getattr(_compiled, "hits", 0)


def _listen() -> None:
    global _listening
    if not _listening:
        with _counting:
            if not _listening:
                import jax

                def count(event: str, _duration_s: float, **_kwargs) -> None:
                    if event == _COMPILE_EVENT:
                        _compiled.n = getattr(_compiled, "n", 0) + 1

                def hit(event: str, **_kwargs) -> None:
                    if event == _HIT_EVENT:
                        _compiled.hits = getattr(_compiled, "hits", 0) + 1

                jax.monitoring.register_event_duration_secs_listener(count)
                jax.monitoring.register_event_listener(hit)
                _listening = True


def program_key(spec: programs_lib.ProgramSpec, mesh: jax.sharding.Mesh) -> str:
    """sha256 of what a loaded program depends on: kind, bytes, mesh shape, device ids."""
    h = hashlib.sha256()
    for part in (
        spec.kind.encode(),
        spec.data,
        repr(tuple(mesh.shape.items())).encode(),
        repr(tuple(int(d.id) for d in mesh.devices.flat)).encode(),
    ):
        h.update(len(part).to_bytes(8, "little"))  # length-prefixed: no two splits collide
        h.update(part)
    return h.hexdigest()


class CompileCache:
    """Loaded programs by program_key, LRU under `limit_bytes`; thread-safe. Counts hits,
    misses and evictions since the worker started."""

    def __init__(self, limit_bytes: int = DEFAULT_LIMIT_MB * 2**20):
        if not isinstance(limit_bytes, int) or limit_bytes < 0:
            raise ValueError(f"the compile cache's limit must be a whole number of bytes >= 0, got {limit_bytes!r}")
        self.limit_bytes = limit_bytes
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[str, tuple[programs_lib.Program, int]] = collections.OrderedDict()
        self._bytes = 0
        self.hits = self.misses = self.evictions = 0

    def load(self, spec: programs_lib.ProgramSpec, mesh: jax.sharding.Mesh) -> programs_lib.Program:
        """The program `spec` bound to `mesh`: from the cache, or loaded now.
        Raises what programs.load raises for a bad spec (nothing is cached then)."""
        from mpmd.runtime.worker import programs as programs_lib

        if spec.kind != "exported":
            return programs_lib.load(spec, mesh)
        key = program_key(spec, mesh)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return entry[0]
            self.misses += 1
        # Loaded outside the lock: another session's load goes on. Two sessions missing the
        # same key at once both load it; one copy is kept.
        program = programs_lib.load(spec, mesh)
        size = len(spec.data)
        with self._lock:
            if key not in self._entries and size <= self.limit_bytes:
                self._entries[key] = (program, size)
                self._bytes += size
                while self._bytes > self.limit_bytes:
                    _, (_, freed) = self._entries.popitem(last=False)
                    self._bytes -= freed
                    self.evictions += 1
        return program

    def stats(self) -> dict:
        """{programs, bytes, limit_bytes, hits, misses, evictions} (the Sessions RPC's `cache`)."""
        with self._lock:
            return {
                "programs": len(self._entries),
                "bytes": self._bytes,
                "limit_bytes": self.limit_bytes,
                "hits": self.hits,
                "misses": self.misses,
                "evictions": self.evictions,
            }
