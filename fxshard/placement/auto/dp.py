"""Dynamic programming on the factor graph: min-sum elimination of chain and tree variables.

A variable with at most two neighbours is eliminated exactly: with one neighbour its best state
per neighbour state folds into that neighbour's unary costs; with two, the best state per pair of
neighbour states becomes an edge between them (a chain link shortens the chain).  What is left
(the core: variables on cycles, and those the memory budget constrains) goes to the ILP; the
eliminated ones are read back from the core's choice in reverse order (``backtrack``).
"""

from __future__ import annotations

import heapq

import torch


def neighbours(nv: int, factors: dict) -> list[dict[int, tuple]]:
    """Per variable: {neighbour: the factor's key}."""
    nbrs: list[dict[int, tuple]] = [dict() for _ in range(nv)]
    for u, v in factors:
        nbrs[u][v] = (u, v)
        nbrs[v][u] = (u, v)
    return nbrs


def eliminate(
    unary: list[torch.Tensor], factors: dict, protected: set[int]
) -> tuple[list, list[bool], list]:
    """Eliminate every unprotected variable of degree <= 2, smallest index first, in place on
    ``unary`` and ``factors``.  Returns (eliminated: [(var, kind, data)] in order, alive flags,
    neighbours of what is left)."""
    nv = len(unary)
    nbrs = neighbours(nv, factors)

    def table(a, b):  # factor oriented (a states) x (b states)
        t = factors[nbrs[a][b]]
        return t if nbrs[a][b][0] == a else t.T

    eliminated = []
    alive = [True] * nv
    queue = sorted(i for i in range(nv) if len(nbrs[i]) <= 2 and i not in protected)
    heapq.heapify(queue)
    while queue:
        v = heapq.heappop(queue)
        if not alive[v] or len(nbrs[v]) > 2 or v in protected:
            continue
        ns = sorted(nbrs[v])
        if not ns:
            eliminated.append((v, 0, None))
        elif len(ns) == 1:
            (u,) = ns
            best, arg = (table(u, v) + unary[v][None, :]).min(dim=1)
            unary[u] = unary[u] + best
            del factors[nbrs[u][v]], nbrs[u][v]
            eliminated.append((v, 1, (u, arg)))
            if len(nbrs[u]) <= 2 and u not in protected:
                heapq.heappush(queue, u)
        else:
            u, w = ns
            m = table(u, v)[:, :, None] + unary[v][None, :, None] + table(v, w)[None, :, :]
            best, arg = m.min(dim=1)
            del factors[nbrs[u][v]], factors[nbrs[v][w]], nbrs[u][v], nbrs[w][v]
            if w in nbrs[u]:
                k = nbrs[u][w]
                factors[k] = factors[k] + (best if k[0] == u else best.T)
            else:
                k = (u, w) if u < w else (w, u)
                factors[k] = best if k[0] == u else best.T
                nbrs[u][w] = nbrs[w][u] = k
            eliminated.append((v, 2, (u, w, arg)))
            for x in (u, w):
                if len(nbrs[x]) <= 2 and x not in protected:
                    heapq.heappush(queue, x)
        alive[v] = False
        nbrs[v] = {}
    return eliminated, alive, nbrs


def backtrack(eliminated: list, unary: list[torch.Tensor], choice: list[int]) -> None:
    """Fill ``choice`` for the eliminated variables from their neighbours' (in place)."""
    for v, kind, data in reversed(eliminated):
        if kind == 0:
            choice[v] = int(unary[v].argmin())
        elif kind == 1:
            u, arg = data
            choice[v] = int(arg[choice[u]])
        else:
            u, w, arg = data
            choice[v] = int(arg[choice[u], choice[w]])
