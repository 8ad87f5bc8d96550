"""Radix tree over token blocks: longest common block-aligned prefix, partial hits, splitting on divergence.

Edges carry a whole number of blocks of `P` token ids (a trailing partial block is never cached). Children are keyed
by the bytes of their first block, so finding the child is one dict lookup and matching the rest of an edge is one
vectorised comparison: a 128K-token walk touches a handful of nodes. Matching always compares token ids (never a
digest). Each block is a `Block` object that lives as long as its metadata; splitting an edge moves blocks between
nodes without copying them, so leases that pin a block's entries survive splits.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass(eq=False)
class Block:
    """One block of `P` tokens on a path: its chained key and, per form, the entries that hold its state.

    `path[form]` is the block's slice of a path form; `snap[form]` the snapshot form's state at the block's end.
    """

    index: int  # absolute block index: tokens [index*P, (index+1)*P)
    key: bytes
    parent_key: bytes
    tokens: np.ndarray  # i32[P]
    node: Any = None
    path: dict = dataclasses.field(default_factory=dict)
    snap: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(eq=False)
class Node:
    tokens: np.ndarray  # i32[n * P] the edge from the parent
    blocks: list  # n Blocks
    parent: "Node | None" = None
    children: dict = dataclasses.field(default_factory=dict)  # first-block bytes -> Node


class RadixTree:
    """Block-aligned radix tree of one namespace."""

    def __init__(self, block_size: int):
        self.P = int(block_size)
        self.root = Node(tokens=np.zeros((0,), np.int32), blocks=[])
        self.num_blocks = 0

    def _key(self, tokens: np.ndarray) -> bytes:
        return np.ascontiguousarray(tokens[: self.P], np.int32).tobytes()

    def match(self, tokens: np.ndarray) -> tuple[list[Block], int | None]:
        """Longest block-aligned prefix of `tokens` present in the tree.

        Returns:
            (blocks matched in order, index of the first differing token if the tree holds a block that agrees with
            `tokens` on a partial block — "token divergence at index k" — else None).
        """
        tokens = np.asarray(tokens, np.int32)
        P, out, node, pos = self.P, [], self.root, 0
        while True:
            if len(tokens) - pos < P:
                return out, None
            child = node.children.get(self._key(tokens[pos:]))
            if child is None:
                return out, self._divergence(node, tokens, pos)
            n = min(len(child.tokens), ((len(tokens) - pos) // P) * P)
            neq = np.nonzero(child.tokens[:n] != tokens[pos:pos + n])[0]
            if neq.size:
                good = (int(neq[0]) // P)
                out.extend(child.blocks[:good])
                return out, pos + int(neq[0])
            out.extend(child.blocks[: n // P])
            pos += n
            if n < len(child.tokens):
                return out, None
            node = child

    def _divergence(self, node: Node, tokens: np.ndarray, pos: int) -> int | None:
        """First differing token among children that share a non-empty partial first block with `tokens[pos:]`."""
        best = None
        for child in node.children.values():
            n = min(self.P, len(tokens) - pos)
            neq = np.nonzero(child.tokens[:n] != tokens[pos:pos + n])[0]
            k = int(neq[0]) if neq.size else n
            if k > 0 and (best is None or k > best):
                best = k
        return None if best is None else pos + best

    def _split(self, node: Node, nblocks: int) -> Node:
        """Split `node`'s edge after `nblocks` blocks; returns the new upper node (the old object keeps the tail)."""
        P = self.P
        parent = node.parent
        head = Node(tokens=node.tokens[: nblocks * P], blocks=node.blocks[:nblocks], parent=parent)
        for b in head.blocks:
            b.node = head
        parent.children[self._key(head.tokens)] = head
        node.tokens = node.tokens[nblocks * P:]
        node.blocks = node.blocks[nblocks:]
        node.parent = head
        head.children[self._key(node.tokens)] = node
        return head

    def insert(self, tokens: np.ndarray, keys: list[bytes], parent_key: bytes) -> list[Block]:
        """Ensure every full block of `tokens` has a node; returns all of them in order (existing ones reused).

        Args:
            tokens: i32[T]; the trailing partial block is ignored.
            keys: chained block keys of the full blocks (identity.block_keys).
            parent_key: key of the (virtual) root, identity.ROOT_KEY.
        """
        tokens = np.asarray(tokens, np.int32)
        P = self.P
        n_full = len(tokens) // P
        assert len(keys) == n_full, (len(keys), n_full)
        out, node, pos = [], self.root, 0
        while pos < n_full * P:
            child = node.children.get(self._key(tokens[pos:]))
            if child is None:
                new_tokens = tokens[pos:n_full * P].copy()
                new = Node(tokens=new_tokens, blocks=[], parent=node)
                for j in range(len(new_tokens) // P):
                    i = pos // P + j
                    new.blocks.append(Block(index=i, key=keys[i], parent_key=keys[i - 1] if i else parent_key,
                                            tokens=new_tokens[j * P:(j + 1) * P], node=new))
                self.num_blocks += len(new.blocks)
                node.children[self._key(new_tokens)] = new
                out.extend(new.blocks)
                return out
            n = min(len(child.tokens), n_full * P - pos)
            neq = np.nonzero(child.tokens[:n] != tokens[pos:pos + n])[0]
            same = (int(neq[0]) // P) * P if neq.size else n
            if same < len(child.tokens):
                child = self._split(child, same // P)
            out.extend(child.blocks)
            pos += same
            node = child
        return out

    def remove_tail(self, node: Node, nblocks: int) -> None:
        """Drop the last `nblocks` blocks of a leaf node's edge (metadata pruning); detaches the node if emptied."""
        assert not node.children and node is not self.root
        nblocks = min(nblocks, len(node.blocks))
        keep = len(node.blocks) - nblocks
        self.num_blocks -= nblocks
        if keep == 0:
            del node.parent.children[self._key(node.tokens)]
            node.parent = None
            return
        node.tokens = node.tokens[: keep * self.P]
        node.blocks = node.blocks[:keep]

    def leaves(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            if not n.children and n is not self.root:
                out.append(n)
            stack.extend(n.children.values())
        return out

    def iter_blocks(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            yield from n.blocks
            stack.extend(n.children.values())
