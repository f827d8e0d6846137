"""Job keys: who may join a job, and who may read its counters.

An aggregator is a shared service that anyone on the network can reach.
Each job has a secret key (``aggnet job create NAME``); its workers sign
every JOIN with an HMAC-SHA256 over the JOIN's fields, a fresh nonce and
the time, so that a JOIN without the key, a JOIN for another rank and a
recorded JOIN replayed from elsewhere are all refused, and a member can
only be replaced by someone holding the job's key. STATS is signed the same
way with the job's key, or with the admin key for every job.

The keys file an aggregator reads (``aggnet serve --keys FILE``), mode
0600::

    {"jobs": {"resnet": "9f0c...64 hex digits"}, "admin": "..."}

Per-packet authentication is out of reach on a switch's data path; there,
admission of each rank's source address (installed at JOIN) is the line,
and the host aggregator checks the same (docs/security.md).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import os
import secrets
import time

from aggnet.protocol.control import ControlError
from aggnet.protocol.wire import ErrorCode

#: seconds a signed message stays valid: clocks of workers and aggregators
#: must agree this well
MAX_SKEW = 300.0
#: nonces an aggregator remembers per keyring (older ones are refused by time)
NONCE_MEMORY = 65536
KEY_BYTES = 32


def new_key() -> str:
    return secrets.token_hex(KEY_BYTES)


def parse_key(text: str, what: str = "job key") -> bytes:
    text = text.strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{what} must be hex digits (aggnet job create makes one), got {len(text)} characters "
                         f"that are not") from None
    if len(key) < 16:
        raise ValueError(f"{what} has {len(key)} bytes; at least 16 are needed")
    return key


def _message(kind: str, job_id: int, sender: int, world: int, fields: dict, nonce: str, ts: float) -> bytes:
    body = json.dumps({k: v for k, v in fields.items() if k not in ("auth", "admin")}, sort_keys=True,
                      separators=(",", ":"))
    return f"aggnet/1 {kind} {job_id} {sender} {world} {nonce} {ts!r} {body}".encode()


def sign(key: bytes, kind: str, job_id: int, sender: int, world: int, fields: dict) -> dict:
    """The ``auth`` object a signed control message carries."""
    nonce = secrets.token_hex(16)
    ts = round(time.time(), 3)
    mac = hmac.new(key, _message(kind, job_id, sender, world, fields, nonce, ts), hashlib.sha256).hexdigest()
    return {"nonce": nonce, "ts": ts, "mac": mac}


class Keyring:
    """The keys an aggregator knows, and the nonces it has seen.

    Without a keys file an aggregator is open (any JOIN is taken, as on a
    trusted single machine); with one, every job must have a key there.
    """

    def __init__(self, jobs: dict[str, bytes] | None = None, admin: bytes | None = None):
        self.jobs = dict(jobs or {})
        self.admin = admin
        self.enforced = jobs is not None or admin is not None
        #: nonce -> who first used it: the same message again from the same
        #: peer is a resend and is answered; from anywhere else, a replay
        self._nonces: collections.OrderedDict = collections.OrderedDict()
        #: (keys file, what its stat said when read): read again on a miss
        self._source: tuple | None = None

    @classmethod
    def load(cls, path: str) -> "Keyring":
        try:
            st = os.stat(path)
            with open(path) as f:
                data = json.load(f)
        except OSError as exc:
            raise ValueError(f"cannot read keys file {path}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"keys file {path} is not JSON: {exc}") from None
        if st.st_mode & 0o077:
            raise ValueError(f"keys file {path} is readable by others (mode {st.st_mode & 0o777:o}); "
                             f"chmod 600 {path}")
        if not isinstance(data, dict) or not isinstance(data.get("jobs", {}), dict):
            raise ValueError(f"keys file {path} must hold {{\"jobs\": {{NAME: KEY}}, \"admin\": KEY}}")
        jobs = {str(name): parse_key(k, f"key of job {name!r} in {path}") for name, k in data.get("jobs", {}).items()}
        admin = parse_key(data["admin"], f"admin key in {path}") if data.get("admin") else None
        ring = cls(jobs, admin)
        ring._source = (path, (st.st_ino, st.st_mtime_ns, st.st_size))
        return ring

    def _reload(self) -> bool:
        """Read the keys file again if it changed since it was read (``aggnet
        job create`` on a running service; the embedded aggregator's next
        job); True when it did. A file that cannot be read keeps the keys
        already known."""
        source = self._source
        if source is None:
            return False
        path, seen = source
        try:
            st = os.stat(path)
        except OSError:
            return False
        if (st.st_ino, st.st_mtime_ns, st.st_size) == seen:
            return False
        try:
            fresh = type(self).load(path)
        except ValueError:
            return False
        # an admin key the file does not hold is the supervisor's own
        # (hosts/service.py), given to its shards in memory: it stays
        self.jobs, self._source = fresh.jobs, fresh._source
        if fresh.admin is not None:
            self.admin = fresh.admin
        return True

    def verify(self, kind: str, job_id: int, sender: int, world: int, name: str | None, fields, peer,
               admin: bool = False) -> bool:
        """True when the message is signed by the job's (or the admin) key;
        raises ControlError for a bad or replayed signature. False when the
        aggregator is open and the message is unsigned."""
        auth = fields.get("admin" if admin else "auth")
        if not self.enforced and auth is None:
            return False
        if admin:
            key, whose = self.admin, "the admin key"
        else:
            key, whose = self.jobs.get(name or ""), f"job {name!r}'s key"
            if key is None and self._reload():
                key = self.jobs.get(name or "")
        if key is None:
            if admin:
                raise ControlError(ErrorCode.REFUSED, "this aggregator has no admin key (add \"admin\" to its "
                                                      "keys file)", "auth_no_key")
            raise ControlError(ErrorCode.REFUSED,
                               f"this aggregator has no key for job {name!r}: create one with `aggnet job create "
                               f"{name} --keys FILE` and give FILE to `aggnet serve --keys`", "auth_no_key")
        if auth is None:
            raise ControlError(ErrorCode.REFUSED, f"{kind} for job {name!r} is not signed; set the job's key "
                                                  f"(AGGNET_JOB_KEY or the client's job_key)", "auth_missing")
        if abs(time.time() - auth["ts"]) > MAX_SKEW:
            raise ControlError(ErrorCode.REFUSED, f"{kind} for job {name!r} is signed {time.time() - auth['ts']:.0f}s "
                                                  f"away from the aggregator's clock (at most {MAX_SKEW:g}s): a "
                                                  f"replay, or clocks out of sync", "auth_stale")
        signed = getattr(fields, "raw", fields)  # the object as sent, not its defaults
        want = hmac.new(key, _message(kind, job_id, sender, world, signed, auth["nonce"], auth["ts"]),
                        hashlib.sha256).hexdigest()
        if not hmac.compare_digest(want, auth["mac"]):
            raise ControlError(ErrorCode.REFUSED, f"{kind} for job {name!r} rank {sender} is not signed with "
                                                  f"{whose}", "auth_bad_mac")
        first = self._nonces.get(auth["nonce"])
        if first is not None and first != peer:
            raise ControlError(ErrorCode.REFUSED, f"{kind} for job {name!r} rank {sender} was seen before from "
                                                  f"another address: a replay", "auth_replay")
        if first is None:
            self._nonces[auth["nonce"]] = peer
            if len(self._nonces) > NONCE_MEMORY:
                self._nonces.popitem(last=False)
        return True


    def stats_view(self, h, payload, peer) -> set | None:
        """Which jobs' tables a STATS may see: None for all (an open
        aggregator, or the admin key), a job's own with its key, none (the
        totals only) unsigned. Raises ControlError for a bad signature."""
        if not self.enforced:
            return None
        from aggnet.protocol import control

        info = control.parse(control.STATS, payload, "STATS")
        if "admin" in info:
            self.verify("STATS", h.job_id, h.sender, h.world, None, info, peer, admin=True)
            return None
        if "job" in info:
            self.verify("STATS", h.job_id, h.sender, h.world, info["job"], info, peer)
            return {info["job"]}
        return set()


def write_job_key(path: str, name: str, key: str | None = None, replace: bool = True) -> str:
    """Add (or, with ``replace``, replace) job ``name``'s key in the keys
    file at ``path``, created 0600; returns the key. Without ``replace`` a
    job that has a key already raises ValueError: its running workers
    hold that key, and a new one would lock them out."""
    data = {"jobs": {}}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
        data.setdefault("jobs", {})
    if not replace and name in data["jobs"]:
        raise ValueError(f"job {name!r} has a key in {path} already (its workers hold it); give it to them again "
                         f"with `aggnet job show {name} --keys {path}`, or make a new one with --replace")
    key = key or new_key()
    data["jobs"][name] = key
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(path + ".tmp", path)
    return key
