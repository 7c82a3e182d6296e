"""An n-gram table of the request's own tokens: which token followed each short context.

For every context of 1..``max_order`` tokens the table counts the tokens that followed it,
and proposes like a variable-order Markov chain (llama.cpp's ``ngram-map``/``ngram-mod``
peers): the next token is looked up under the longest context, ending with the tokens proposed
so far, that has counts, and so on step by step. Unlike prompt lookup, a chain may stitch
together steps that never occurred in that order, so it still proposes where the text has not
repeated a whole passage; each step, though, followed its context somewhere in the text.

A node's conditional probability is ``count / (occurrences + prior)`` under the context it was
looked up with; its children are the context's counted followers, most counted first (the one
counted first on ties). Tree growth is bounded by ``max_nodes`` expansions, each
``max_order`` lookups.

Memory: at most ``max_contexts`` contexts (a context first seen beyond that is not counted)
and ``followers`` counted tokens per context, kept as Misra-Gries does: a new token finding
the counts full lowers every count by one instead of entering (counts that reach 0 leave), so
a token that followed more than 1/(followers + 1) of the occurrences always keeps a count, and
a count never exceeds the true one (an estimate errs low). A run of one repeated token holds
``max_order`` contexts of one follower each, whatever its length.
"""

from __future__ import annotations

from collections.abc import Iterable

from hetspec.speculative.drafting.model_free import Child, TreeProposal, ranked_tree


class Followers:
    """The tokens counted after one context, and how many times the context was followed."""

    __slots__ = ("counts", "occurrences")

    def __init__(self) -> None:
        self.occurrences = 0
        self.counts: dict[int, int] = {}

    def add(self, token: int, most: int) -> None:
        self.occurrences += 1
        counts = self.counts
        if token in counts:
            counts[token] += 1
        elif len(counts) < most:
            counts[token] = 1
        else:  # Misra-Gries: the new token cancels one count of every counted one
            for counted in list(counts):
                counts[counted] -= 1
                if not counts[counted]:
                    del counts[counted]


class NgramTable:
    """A ``ModelFreeDrafter`` following counts of which token came after each context of
    1..``max_order`` tokens, the longest counted context first."""

    def __init__(
        self,
        *,
        max_order: int = 3,
        max_depth: int = 32,
        followers: int = 4,
        prior: float = 0.5,
        max_contexts: int = 1 << 18,
    ) -> None:
        if max_order < 1 or max_depth < 1 or followers < 1 or prior <= 0:
            raise ValueError("max_order, max_depth and followers must be at least 1, prior above 0")
        self.max_order = max_order
        self.max_depth = max_depth
        self.followers = followers
        self.prior = prior
        self.max_contexts = max_contexts
        self._tokens: list[int] = []
        self._table: dict[tuple[int, ...], Followers] = {}  # contexts of every order together

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def contexts(self) -> int:
        return len(self._table)

    @property
    def counted(self) -> int:
        """(context, token) counts held: the table's size besides its contexts."""
        return sum(len(seen.counts) for seen in self._table.values())

    def extend(self, tokens: Iterable[int]) -> None:
        history, table, max_order = self._tokens, self._table, self.max_order
        window = tuple(history[-max_order:])  # the contexts before the next token, longest
        for token in map(int, tokens):
            known = len(window)
            for order in range(1, known + 1):
                context = window[known - order :]
                seen = table.get(context)
                if seen is None:
                    if len(table) >= self.max_contexts:
                        continue
                    seen = table[context] = Followers()
                seen.add(token, self.followers)
            history.append(token)
            window = (*window, token)[-max_order:]

    def propose(self, max_tokens: int) -> list[int]:
        """The likeliest child at every step: ``_children``'s first, without listing the rest."""
        chain: list[int] = []
        window = tuple(self._tokens[-self.max_order :])
        while len(chain) < min(max_tokens, self.max_depth):
            seen = self._longest_counted(window)
            if seen is None:
                break
            token = max(seen.counts, key=seen.counts.__getitem__)  # the first counted on ties
            chain.append(token)
            window = (*window, token)[-self.max_order :]
        return chain

    def propose_tree(self, max_nodes: int, max_children: int | None = None) -> TreeProposal:
        window = tuple(self._tokens[-self.max_order :])
        return ranked_tree(window, self._children, max_nodes, self.max_depth, max_children)

    def _children(self, window: tuple[int, ...]) -> list[Child]:
        """The counted followers of the longest counted context ending ``window`` (the last
        ``max_order`` tokens of the text and of the path so far), most counted first."""
        seen = self._longest_counted(window)
        if seen is None:
            return []
        total = seen.occurrences + self.prior
        ranked = sorted(seen.counts.items(), key=lambda item: -item[1])  # stable: first counted
        return [
            (token, count / total, (*window, token)[-self.max_order :]) for token, count in ranked
        ]

    def _longest_counted(self, window: tuple[int, ...]) -> Followers | None:
        """The followers of the longest context ending ``window`` that has counts."""
        for order in range(len(window), 0, -1):
            seen = self._table.get(window[-order:])
            if seen is not None and seen.counts:
                return seen
        return None
