"""Who is calling a worker: the cluster token, or one job's credential derived from it.

A shared cluster (`mpmd worker --shared`, runtime/manager/core.py) has one secret, the cluster
token: the manager and the workers hold it, users do not. It is the admin credential
(open and close sessions, list them, stop the worker). Each job gets its own credential

    "job." + job_id + "." + hex(HMAC-SHA256(key=cluster token, msg=b"mpmd-job\\0" + job_id))

which the manager hands to the job at Submit. A worker checks it with the token alone (no
table of issued credentials to keep in step with the manager), and the job id inside it
names the only session the caller may touch. Without the token nobody can make a
credential, and holding one job's credential tells nothing about another's (the MAC is a
PRF of the id). The "mpmd-job\\0" prefix keeps these MACs apart from any other use of the
token as a key. Both kinds travel in the same gRPC metadata key (runtime/worker/service.py
TOKEN_KEY).
"""

from __future__ import annotations

import hashlib
import hmac
import re

JOB_PREFIX = "job."
_JOB_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")
_DOMAIN = b"mpmd-job\0"


def check_job_id(job_id) -> str:
    """`job_id` if it is 1 to 64 of [a-z0-9-], starting with a letter or digit (it names
    directories and log lines, and sits between dots in a credential); ValueError otherwise."""
    if not isinstance(job_id, str) or not _JOB_ID.fullmatch(job_id):
        raise ValueError(
            f"a job id must be 1 to 64 characters of a-z, 0-9 and '-', starting with a "
            f"letter or digit; got {job_id!r:.80}"
        )
    return job_id


def _mac(cluster_token: str, job_id: str) -> str:
    return hmac.new(cluster_token.encode(), _DOMAIN + job_id.encode(), hashlib.sha256).hexdigest()


def job_credential(cluster_token: str, job_id: str) -> str:
    """The credential of job `job_id` on the cluster whose token is `cluster_token`."""
    return f"{JOB_PREFIX}{check_job_id(job_id)}.{_mac(cluster_token, job_id)}"


def job_of(credential, cluster_token: str) -> str | None:
    """The job id `credential` was made for when its MAC verifies under `cluster_token`, else
    None (a malformed string, another cluster's token, another job's MAC, the bare token)."""
    if not isinstance(credential, str) or not credential.startswith(JOB_PREFIX):
        return None
    job_id, dot, mac = credential[len(JOB_PREFIX) :].rpartition(".")
    if not dot or not _JOB_ID.fullmatch(job_id):
        return None
    # compare_digest on equal-length ASCII: the time taken tells nothing about the MAC.
    return job_id if hmac.compare_digest(mac.encode(), _mac(cluster_token, job_id).encode()) else None


def is_cluster_token(credential, cluster_token: str) -> bool:
    """Whether `credential` is the cluster token itself (compared in constant time)."""
    return isinstance(credential, str) and hmac.compare_digest(credential.encode(), cluster_token.encode())
