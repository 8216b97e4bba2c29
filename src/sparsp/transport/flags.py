"""The flag protocol of the slot windows: flag words, their layout, and waiting on them.

Used by ``slots.SlotWindows`` (and the ``host`` and ``ipc`` transports built on it) to say
"this slot holds a payload" and "this slot is free again" without any collective
(docs/design.md "The mechanism", decoupled transfer runtime; paper §6.1).

**A flag word** is one 32-bit word, from the high bit to the low one
``epoch mod 2^8 | use mod 2^10 | count`` (``encode_flag`` / ``decode_flag``):

- *epoch*: the attention call, bumped by every ``fence``;
- *use*: how many times this slot was used before within the call (the k-th transfer on a
  (producer, consumer) pair uses slot ``k mod window`` for the ``k // window``-th time), at
  most ``MAX_USES`` per slot per call;
- *count*: chunks landed, for 'published' (a chunked copy advances it chunk by chunk, so the
  consumer can copy chunk j while chunk j+1 is in flight), at most ``MAX_COUNT``; always 1
  for 'released'.

**Who writes which word.** Every word has exactly one writer. Each rank's segment begins with
its flag page (``FlagLayout``), one 64-byte line per word so that two writers never share a
cache line: line 0 is the owner's barrier counter, line 1 scratch (capability probes), then
for every consumer c and slot s of the owner's window a 'published' line, written by the owner
(the producer) once the payload for c is in the slot, and a 'released' line, written by
consumer c (remotely, into the producer's page) once its copy out of the slot has completed.
The producer waits on 'released' before it packs into a slot again; the consumer waits on
'published' before it copies out.

**Comparison.** A waiter holds the value it expects and passes once the word is *cyclically*
greater or equal (``flag_reached``): ``(int32)(value - expected) >= 0``, the condition of
``cuStreamWaitValue32`` with GEQ, so the host and the GPU wait on exactly the same
condition. Every expected value has a count ≥ 1, and a word's value from an earlier epoch, up
to 127 calls back, is cyclically smaller than any value expected in this one: it is never
mistaken for a fresh one. Every fence resets each word its writer owns to ``(new epoch, 0,
0)`` after a barrier that all ranks reach only once done with the old epoch, so a word is never
more than one epoch stale, however long its pair stays silent. The reset is not followed by a
second barrier: a peer already in the new epoch sees either the old value or the reset one,
both below anything it waits for, and the word's one writer resets it before its own first
write of the new epoch (program order; its GPU writes are queued after the host store).

**Waiting.** ``wait_flag`` polls the word with a ``Backoff``: it first spins for ``spin_s``
(yielding the GIL), then sleeps, doubling from a few microseconds to ``cap_s``. A GPU waiter
spins for milliseconds with a low cap (each missed poll adds latency to every transfer); a CPU
waiter gives its cores back to its peers sooner. Past ``timeout_s`` it raises
``TimeoutError`` with the caller's ``describe(last value)``, which names the rank, the peer,
the slot and the epoch: a dead or stuck peer raises instead of hanging.

**Memory ordering on the CPU path.** The writer stores the payload, then the flag; the reader
loads the flag, then the payload. Each is a separate C call (torch copy, numpy scalar store
or load), so the compiler cannot reorder them, and x86-64 (TSO) keeps store→store and
load→load order. Weakly ordered CPUs (aarch64) would need explicit barriers here.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

import numpy as np

from .shm import PAGE, round_up

EPOCH_BITS, USE_BITS, COUNT_BITS = 8, 10, 14
MAX_USES = 1 << USE_BITS  # slot reuses per peer per call (window × this = publishes per call)
MAX_COUNT = (1 << COUNT_BITS) - 1  # chunks per slot
_MASK32 = 0xFFFFFFFF


def encode_flag(epoch: int, use: int, count: int) -> int:
    if not 0 <= use < MAX_USES:
        raise ValueError(f"slot use {use} out of range: more than {MAX_USES} transfers per slot "
                         "in one attention call; call fence() more often or widen the window")
    if not 0 <= count <= MAX_COUNT:
        raise ValueError(f"chunk count {count} exceeds {MAX_COUNT}; raise chunk_bytes")
    return ((epoch % (1 << EPOCH_BITS)) << (USE_BITS + COUNT_BITS)) | (use << COUNT_BITS) | count


def decode_flag(value: int) -> tuple[int, int, int]:
    """(epoch mod 2^8, use, count) of a flag word."""
    value &= _MASK32
    return (value >> (USE_BITS + COUNT_BITS), (value >> COUNT_BITS) & (MAX_USES - 1),
            value & MAX_COUNT)


def flag_reached(value: int, expected: int) -> bool:
    """The condition of ``cuStreamWaitValue32`` (GEQ): ``(int32)(value - expected) >= 0``."""
    return ((int(value) - expected) & _MASK32) < 0x80000000


def describe_flag(value: int) -> str:
    e, u, c = decode_flag(int(value))
    return f"epoch {e} use {u} count {c}"


@dataclasses.dataclass(frozen=True, slots=True)
class FlagLayout:
    """Where the words of one producer's flag page are; one 64-byte line per word.

    line 0: the owner's barrier counter; line 1: scratch (capability probes); then for every
    consumer c and slot s a 'published' line (written by the producer) and a 'released' line
    (written by consumer c). Separate lines keep the two writers off each other's cache line.
    """

    world_size: int
    window: int

    LINE_WORDS = 16  # 64 bytes

    @property
    def nbytes(self) -> int:
        return round_up((2 + 2 * self.world_size * self.window) * self.LINE_WORDS * 4, PAGE)

    @property
    def nwords(self) -> int:
        return self.nbytes // 4

    barrier = 0
    scratch = LINE_WORDS

    def published(self, consumer: int, slot: int) -> int:
        return (2 + 2 * (consumer * self.window + slot)) * self.LINE_WORDS

    def released(self, consumer: int, slot: int) -> int:
        return self.published(consumer, slot) + self.LINE_WORDS


class Backoff:
    """Poll politely: spin (yielding the GIL) for ``spin_s``, then sleeps that double to a cap.

    A GPU waiter spins for milliseconds: the sleep after a missed poll is pure latency added to
    every transfer (a 200 µs cap cost ~0.2 ms per exchange on the H200s, 20 % at 256 MiB over
    NVLink); a CPU waiter shares two cores with its peers and gives them back sooner.
    """

    def __init__(self, spin_s: float = 5e-5, first_s: float = 5e-6, cap_s: float = 1e-3) -> None:
        self.spin_until = time.monotonic() + spin_s
        self.first_s, self.cap_s = first_s, cap_s
        self.delay = first_s

    def pause(self) -> None:
        if time.monotonic() < self.spin_until:
            time.sleep(0)
        else:
            time.sleep(self.delay)
            self.delay = min(self.cap_s, self.delay * 2)


def wait_flag(words: np.ndarray, index: int, expected: int, *, timeout_s: float,
              describe: Callable[[int], str], cap_s: float = 1e-3, spin_s: float = 5e-5) -> None:
    """Wait until ``words[index]`` reaches ``expected``; ``TimeoutError(describe(last value))``."""
    if flag_reached(words[index], expected):
        return
    deadline = time.monotonic() + timeout_s
    backoff = Backoff(spin_s=spin_s, cap_s=cap_s)
    while True:
        backoff.pause()
        value = int(words[index])
        if flag_reached(value, expected):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(describe(value))


@dataclasses.dataclass(frozen=True, slots=True)
class _Awaited:
    words: np.ndarray
    index: int
    expected: int
    deadline: float
    timeout_s: float
    what: str  # "rank r: fetch from peer p: slot s (use u, chunk c) of epoch e"


class DeviceWaits:
    """Flags that GPU streams wait on (``cuStreamWaitValue32``), checked on the host.

    ``add`` registers one with its deadline (now + the transport's timeout). ``settle`` polls
    every registered flag until its deadline and raises ``TimeoutError`` naming the first that
    never came, after storing the awaited value into each missing word, so that no stream
    stays blocked on a dead peer. A watchdog thread does the same for flags past their deadline
    while the host is blocked somewhere else — a CUDA call that waits for the device (an
    allocation that has to map memory, the caller's own ``synchronize``) would otherwise wait
    forever behind the blocked stream — and keeps the error for the next ``settle``. The
    released stream then copies stale bytes: the call that raises has no valid output.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: list[_Awaited] = []
        self._expired: list[str] = []
        self._thread: threading.Thread | None = None
        self._stopped = False

    def add(self, words: np.ndarray, index: int, expected: int, timeout_s: float, what: str) -> None:
        with self._cond:
            self._items.append(_Awaited(words, index, expected, time.monotonic() + timeout_s,
                                        timeout_s, what))
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._watch, name="sparsp-flag-watchdog",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def settle(self, *, cap_s: float, spin_s: float) -> None:
        with self._cond:
            items, self._items = self._items, []
            expired, self._expired = self._expired, []
        for i, a in enumerate(items):
            try:
                wait_flag(a.words, a.index, a.expected,
                          timeout_s=max(0.0, a.deadline - time.monotonic()), cap_s=cap_s,
                          spin_s=spin_s, describe=lambda v, a=a: _missing(a, v))
            except TimeoutError:
                for b in items[i:]:
                    _release(b)
                raise
        if expired:
            more = f" (and {len(expired) - 1} more)" if len(expired) > 1 else ""
            raise TimeoutError(expired[0] + more)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def _watch(self) -> None:
        with self._cond:
            while not self._stopped:
                now = time.monotonic()
                for a in [a for a in self._items if a.deadline <= now]:
                    self._items.remove(a)
                    value = _release(a)
                    if value is not None:
                        self._expired.append(_missing(a, value) + "; the stream waiting for it "
                                             "was released, so this call's output is not valid")
                nxt = min((a.deadline for a in self._items), default=None)
                self._cond.wait(None if nxt is None else max(nxt - now, 1e-3))


def _missing(a: _Awaited, value: int) -> str:
    return not_published(a.what, a.timeout_s, value)


def not_published(what: str, timeout_s: float, value: int) -> str:
    """The message of a 'published' flag that never came: ``what`` names rank, peer, slot."""
    return f"{what} not published within {timeout_s:g} s (flag holds {describe_flag(value)})"


def _release(a: _Awaited) -> int | None:
    """Store the awaited value if the word lacks it (the GPU waiter runs on); the old value,
    or None when it had arrived."""
    try:
        value = int(a.words[a.index])
        if flag_reached(value, a.expected):
            return None
        a.words[a.index] = a.expected
        return value
    except (IndexError, ValueError):  # the segment is gone (closed): nothing waits on it
        return None
