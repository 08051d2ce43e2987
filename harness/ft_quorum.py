"""A quorum of replica groups in one process, answering ``ReplicaGroup`` as torchft's
``Manager`` does, so that the real ``ReplicaGroup`` (its split, commit, rewind, heal
and stop agreement) runs in a fast test, with no lighthouse and no process group.

A test decides each round (``Quorum.round``): who takes part, who dies during the step
(it never reaches the all-reduce: nobody commits, as when torchft's all-reduce
breaks), whether the vote fails anyway, and whether the quorum stalls (too few live
groups: it comes when the test calls ``release``, or fails after ``stall`` seconds as
torchft's does after its quorum timeout). Each group's try runs in a thread of its
own (``Quorum.run``): the all-reduce waits for every live participant's buffer and
averages them, as torchft's does. A group behind the quorum's highest step heals
inside its ``start_quorum`` from the lowest participant at that step (its
``_peer_state``, taken in that participant's own ``start_quorum``, between its steps),
as torchft's quorum does.

``Relay``: a real lighthouse's TCP port relayed on 127.0.0.1, which a test cuts (the
listener closed, every connection reset): what the groups see of a lighthouse whose
host died mid-run, without a process to start (an in-process ``LighthouseServer``'s
``shutdown`` keeps answering on the connections it has).

Never: stand in for the data loader, DCP or a checkpoint.
"""

from __future__ import annotations

import socket
import struct
import threading
import uuid
from urllib.parse import urlsplit

import torch

# A participant that never reaches the all-reduce breaks it after this long (torchft's
# fails after fault_tolerance.timeout_seconds): a test whose group leaves a round it is
# in fails in seconds, not at the test's time limit.
ALLREDUCE_TIMEOUT_S = 10.0


class _Done:
    def wait(self):
        return None


class Quorum:
    def __init__(self):
        self.managers: dict[int, Manager] = {}
        self._round = None
        # Each round's id, as torchft's quorum id and members name a quorum: another in
        # every round and in every Quorum (a job's lives never share one).
        self._name, self._rounds = uuid.uuid4().hex[:8], 0

    def manager(self, group: int) -> Manager:
        self.managers[group] = Manager(self, group)
        return self.managers[group]

    def round(self, participants: list[int], dies: tuple = (), fails: bool = False,
              stall: float = 0.0):  # fmt: skip
        """The next quorum: ``participants`` (group ids, in the order torchft ranks them),
        ``dies`` of them never reach the all-reduce, ``fails``: the vote says no, and
        ``stall``: the quorum waits for ``release`` that long, then fails."""
        live = [g for g in participants if g not in dies]
        self._rounds += 1
        top = max(self.managers[g].step for g in participants)
        self._round = {
            "participants": sorted(participants), "dies": set(dies), "fails": fails,
            "barrier": threading.Barrier(len(live), timeout=ALLREDUCE_TIMEOUT_S), "sum": None, "lock": threading.Lock(),
            "top": top,
            "source": min(g for g in participants if self.managers[g].step == top),
            "behind": any(self.managers[g].step < top for g in participants),
            "sent": None, "ready": threading.Event(),
            "stall": stall, "released": threading.Event(),
        }  # fmt: skip

    def release(self):
        """The stalled quorum comes (the groups it waited for are back)."""
        self._round["released"].set()

    def run(self, tries: dict):
        """Run ``{group: fn}`` each in its own thread (one try of a step); re-raise the
        first failure."""
        errors = []

        def guarded(fn):
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - re-raised below, in the test's thread
                errors.append(e)
                self._round["barrier"].abort()

        threads = [threading.Thread(target=guarded, args=(fn,)) for fn in tries.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]


class Manager:
    """One group's view of the ``Quorum``: the calls ``ReplicaGroup`` makes."""

    def __init__(self, quorum: Quorum, group: int):
        self.quorum, self.group = quorum, group
        self.step = 0  # committed steps, as torchft counts them
        self.replica = None  # the ReplicaGroup (its heal and peer state), set by the test
        self.errored = None  # report_error's, until the vote

    def load_state_dict(self, state: dict):
        self.step = state["step"]

    @property
    def _quorum_id(self) -> str:  # what ReplicaGroup.quorum_id reads of torchft's Manager
        return f"{self.quorum._name}-{self.quorum._rounds}"

    def start_quorum(self):
        r = self.quorum._round
        if r["stall"] and not r["released"].wait(timeout=r["stall"]):
            raise TimeoutError("Timeout expired")  # as torchft says it after its quorum timeout
        if r["behind"] and self.group == r["source"]:  # sends its state from its quorum
            r["sent"] = self.replica._peer_state()
            r["ready"].set()
        if self.step < r["top"]:  # behind: heal from the source, as torchft does
            if not r["ready"].wait(timeout=60):
                raise TimeoutError("the heal's source never reached its quorum")
            self.replica._heal(r["sent"])
            self.step = r["top"]

    def participating_rank(self) -> int | None:
        r = self.quorum._round
        return r["participants"].index(self.group) if self.group in r["participants"] else None

    def num_participants(self) -> int:
        return len(self.quorum._round["participants"])

    def current_step(self) -> int:
        return self.step

    def allreduce(self, flat: torch.Tensor):
        r = self.quorum._round
        with r["lock"]:
            r["sum"] = flat.clone() if r["sum"] is None else r["sum"] + flat
        r["barrier"].wait()
        flat.copy_(r["sum"] / len(r["participants"]))
        r["barrier"].wait()  # every group has read the sum before the next round
        return _Done()

    def report_error(self, error: Exception):  # this group's vote is no, for this try
        self.errored = error

    def should_commit(self) -> bool:
        r = self.quorum._round
        ok = not r["dies"] and not r["fails"] and self.errored is None
        self.errored = None
        if ok:
            self.step += 1
        return ok

    def shutdown(self, wait: bool = False):
        return None


class Relay:
    """``address``'s TCP port relayed on 127.0.0.1 (``.address``: what the groups are
    given); ``cut()`` makes it look dead: nobody listens, and every relayed connection
    is reset."""

    def __init__(self, address: str):
        target = urlsplit(address)
        self._target = (target.hostname, target.port)
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                near, _ = self._server.accept()
                far = socket.create_connection(self._target)
            except OSError:  # cut
                return
            with self._lock:
                self._sockets += [near, far]
            for a, b in ((near, far), (far, near)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket):
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass

    def cut(self):
        for s in [self._server, *self._sockets]:
            try:  # a reset, not a goodbye: SO_LINGER 0
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
