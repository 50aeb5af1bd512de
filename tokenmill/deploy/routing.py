"""Which replica gets a request: the routing policy, free of Ray (the Ray router wraps it).

A replica's prefix cache holds what it was sent, so the router keeps an approximate picture of
each replica's cache, `PrefixIndex`: the prompts it routed there, cut into blocks and hashed as
chains (block i's hash covers blocks 0..i, like a radix tree's path), least recently used
blocks forgotten past a bound. `RouterState.rank` then orders the replicas for one request:

1. the replica of the request's session (multi-turn chat), if it is not overloaded;
2. the replicas holding the longest matching prefix, if not overloaded;
3. every replica, least loaded first.

"Overloaded" is `max_imbalance` more requests in flight than the least loaded replica: one hot
prefix or session cannot pile its requests onto one replica while others idle; past that bound
the request goes elsewhere and that replica's cache learns the prefix too.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

TOKEN_BLOCK = 16  # token ids per block: a KV page
TEXT_BLOCK = 64  # characters per block: about 16 tokens


@dataclass(frozen=True)
class RoutedRequest:
    """One HTTP request on its way from the ingress to a replica, with what the router reads:
    the chained block hashes of its prompt and its session (if any). `avoid` names replicas
    that failed it already (a retry)."""

    method: str
    path: str
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()
    query: str = ""
    prefix: tuple[bytes, ...] = ()
    session: str | None = None
    avoid: frozenset[str] = field(default_factory=frozenset)


def prefix_blocks(body: Mapping[str, Any]) -> tuple[bytes, ...]:
    """The chained block hashes of an OpenAI body's prompt (`prompt`: text, token ids, or a
    list of one; `messages`: the chat, role and text of each message in order). A partial last
    block is left out: no cache holds it either."""
    if "messages" in body and isinstance(body["messages"], list):
        return _chain(_chat_text(body["messages"]).encode("utf-8"), TEXT_BLOCK * 4)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _chain(prompt.encode("utf-8"), TEXT_BLOCK * 4)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        data = b"".join(t.to_bytes(8, "little", signed=True) for t in prompt)
        return _chain(data, TOKEN_BLOCK * 8)
    return ()


def _chat_text(messages: list[Any]) -> str:
    parts = []
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(_part_text(p) for p in content if isinstance(p, Mapping))
        parts.append(f"{message.get('role', '')}\x1f{content or ''}\x1e")
    return "".join(parts)


def _part_text(part: Mapping[str, Any]) -> str:
    """A content part's text; an image part stands for a digest of its URL (a data URL is the
    image), so that requests with the same image prefer the replica holding its pages."""
    if part.get("type") != "image_url":
        return str(part.get("text", ""))
    image = part.get("image_url")
    url = image.get("url", "") if isinstance(image, Mapping) else ""
    digest = hashlib.blake2b(str(url).encode("utf-8", "surrogatepass"), digest_size=8)
    return f"\x1d{digest.hexdigest()}\x1d"


def _chain(data: bytes, block_bytes: int) -> tuple[bytes, ...]:
    hashes = []
    previous = b""
    for start in range(0, len(data) - block_bytes + 1, block_bytes):
        previous = hashlib.blake2b(previous + data[start : start + block_bytes], digest_size=8)
        previous = previous.digest()
        hashes.append(previous)
    return tuple(hashes)


class PrefixIndex:
    """Per replica, the block hashes of the prompts routed to it (LRU, `max_blocks` each)."""

    def __init__(self, max_blocks: int = 200_000) -> None:
        self.max_blocks = max_blocks
        self._blocks: dict[str, OrderedDict[bytes, None]] = {}

    def match(self, replica: str, prefix: Sequence[bytes]) -> int:
        """How many leading blocks of `prefix` `replica` was sent."""
        blocks = self._blocks.get(replica)
        if not blocks:
            return 0
        # Chained hashes: block i present means the path to it was sent too (unless evicted
        # first, which LRU order makes rare: a path's blocks are touched together).
        lo, hi = 0, len(prefix)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if prefix[mid - 1] in blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def insert(self, replica: str, prefix: Sequence[bytes]) -> None:
        blocks = self._blocks.setdefault(replica, OrderedDict())
        for h in prefix:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def remove(self, replica: str) -> None:
        self._blocks.pop(replica, None)

    def size(self, replica: str) -> int:
        return len(self._blocks.get(replica, ()))


@dataclass
class RouterState:
    """The routing policy's state: the prefix index, sessions, and requests in flight."""

    max_imbalance: int = 8
    max_sessions: int = 100_000
    index: PrefixIndex = field(default_factory=PrefixIndex)
    sessions: OrderedDict[str, str] = field(default_factory=OrderedDict)
    in_flight: dict[str, int] = field(default_factory=dict)
    sent: dict[str, int] = field(default_factory=dict)
    _owner: dict[str, str] = field(default_factory=dict)  # request id -> replica

    def rank(self, replicas: Sequence[str], request: RoutedRequest | None) -> list[list[str]]:
        """`replicas` in ranks, most preferred first (each rank tried before the next)."""
        usable = [r for r in replicas if request is None or r not in request.avoid]
        usable = usable or list(replicas)
        if not usable:
            return []
        load = {r: self.in_flight.get(r, 0) for r in usable}
        # Ties go to the replica sent the fewest requests, so idle replicas take turns.
        by_load = sorted(usable, key=lambda r: (load[r], self.sent.get(r, 0)))
        least = load[by_load[0]]
        fit = [r for r in by_load if load[r] <= least + self.max_imbalance]
        ranks: list[list[str]] = []
        if request is not None and request.session is not None:
            home = self.sessions.get(request.session)
            if home in fit:
                ranks.append([home])
        if request is not None and request.prefix:
            matches = {r: self.index.match(r, request.prefix) for r in fit}
            best = max(matches.values())
            if best > 0:
                ranks.append([r for r in fit if matches[r] == best])
            else:
                # Nobody holds it: the replica holding the least, so prefixes spread out.
                smallest = min(self.index.size(r) for r in fit)
                ranks.append([r for r in fit if self.index.size(r) == smallest])
        ranks.append(by_load)
        return ranks

    def routed(self, request: RoutedRequest | None, request_id: str, replica: str) -> None:
        """`request` was sent to `replica`."""
        self.in_flight[replica] = self.in_flight.get(replica, 0) + 1
        self.sent[replica] = self.sent.get(replica, 0) + 1
        self._owner[request_id] = replica
        if request is None:
            return
        if request.prefix:
            self.index.insert(replica, request.prefix)
        if request.session is not None:
            self.sessions[request.session] = replica
            self.sessions.move_to_end(request.session)
            if len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)

    def completed(self, request_id: str) -> None:
        replica = self._owner.pop(request_id, None)
        if replica is not None and self.in_flight.get(replica, 0) > 0:
            self.in_flight[replica] -= 1

    def forget(self, replica: str) -> None:
        """`replica` is gone: its cache, sessions and counts with it."""
        self.index.remove(replica)
        self.in_flight.pop(replica, None)
        self.sent.pop(replica, None)
        for session in [s for s, r in self.sessions.items() if r == replica]:
            del self.sessions[session]
