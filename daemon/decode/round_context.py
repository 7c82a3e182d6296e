"""What every round of one request reads and advances: the pair, both sides' state, the
request's sampling, the sequence's position, and the step that commits a verdict."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetspec.daemon.decode.requests import cut_at_end
from hetspec.daemon.decode.round_sides import DrafterSide, VerifierSide, WorkerPair
from hetspec.daemon.decode.round_stats import SpeculativeStats
from hetspec.daemon.decode.verdict_site import Judged, VerdictSite, judge, verdict_site
from hetspec.protocol import TokenLogprob
from hetspec.protocol import worker_messages as m
from hetspec.protocol.sampling import SamplingParams
from hetspec.speculative.constrain.constraint import Constraint
from hetspec.speculative.control.budget import BudgetController
from hetspec.speculative.control.rounds import Plan
from hetspec.speculative.drafting.model_free import ModelFreeDrafter
from hetspec.speculative.verify.logprobs import token_logprob
from hetspec.speculative.verify.samplers import KeyedSampler, Sampler
from hetspec.speculative.verify.verdicts import RowsOnDemand, Verdict


class RoundKind(enum.Enum):
    ALONE = "alone"  # gamma 0: the target decodes a few tokens by itself
    PLAIN = "plain"  # a draft of branches x gamma (or by the rule), verified as one tree
    TREE = "tree"  # EAGLE-2's dynamic tree, its best ranked prefix verified
    OVERLAPPED = "overlapped"  # the next round drafted while this one is verified
    LOOKUP = "lookup"  # a model-free draft from the request's own tokens, verified as a tree
    GRAMMAR = "grammar"  # the tokens a grammar forces, verified with no draft


@dataclass(frozen=True)
class Emitted:
    tokens: list[int]  # verified tokens, cut at EOS and at the request's budget
    stopped: bool  # EOS reached
    logprobs: list[TokenLogprob] | None = None  # one per emitted token, when asked


@dataclass
class RoundContext:
    """One request's decoding state between rounds. ``position``: the next token's index in
    the sequence (the keyed noise's key); ``settled_at``: when the last round's period ended
    (its report), so that a round's period counts everything between its calls."""

    pair: WorkerPair
    controller: BudgetController
    stats: SpeculativeStats
    params: SamplingParams
    sampler: Sampler
    ends: frozenset[int]
    logprobs: int | None  # top log-probabilities per token; None: not asked
    verifier: VerifierSide
    drafter: DrafterSide
    position: int = 0
    settled_at: float = 0.0
    fixed: Plan | None = None  # the request's own plan, else the controller's
    alone_streak: int = 0  # rounds in a row without a draft, up to the last one
    # the request's model-free drafter, fed every committed token (None: not used), and the
    # children it may propose below a node (1: chains, for a verifier of chains only)
    lookup: ModelFreeDrafter | None = None
    lookup_children: int | None = None
    constraint: Constraint | None = None  # the request's grammar, advanced by every commit
    grammar_at: m.GrammarAt | None = None  # the same for the workers: its text, where it starts

    @property
    def keyed(self) -> bool:
        return isinstance(self.sampler, KeyedSampler)

    def kind(self, plan: Plan) -> RoundKind:
        """Which round runs ``plan``. Trees replace single-branch plain rounds of greedy and
        keyed requests; a drawn request keeps drawn chains (a tree's chosen nodes would be
        accepted with the target's probability of each)."""
        if plan.gamma == 0:
            return RoundKind.ALONE
        if plan.overlap and self.constraint is None:  # a run-ahead's guess reads no mask
            return RoundKind.OVERLAPPED
        tree_fits = (
            plan.branches == 1
            and not plan.rule
            and (self.params.greedy or self.keyed)
            and self.constraint is None  # a grammar's draft is one chain
        )
        return RoundKind.TREE if tree_fits and self.controller.limits.tree_k else RoundKind.PLAIN

    def site(self, *, drawn_walk: bool) -> VerdictSite:
        return verdict_site(
            self.params,
            self.logprobs,
            self.sampler,
            drawn_walk=drawn_walk,
            constrained=self.constraint is not None,
        )

    def judge(
        self,
        site: VerdictSite,
        tokens: Sequence[int],
        parents: Sequence[int],
        verified: m.Verified,
        draft_rows: RowsOnDemand | np.ndarray | None = None,
    ) -> Judged:
        verifier = self.pair.verifier
        return judge(
            site,
            tokens,
            parents,
            verified,
            arena=self.pair.arena,
            vocab_size=verifier.ready.vocab.size,
            verifier_name=verifier.spec.name,
            params=self.params,
            sampler=self.sampler,
            position=self.position,
            draft_rows=draft_rows,
            constraint=self.constraint,
        )

    def emitted(self, tokens: list[int]) -> None:
        """The sequence grew by ``tokens`` (committed): the model-free drafter learns them,
        the grammar advances past them."""
        if self.lookup is not None:
            self.lookup.extend(tokens)
        if self.constraint is not None:
            self.constraint.advance(tokens)

    def commit(
        self,
        verdict: Verdict,
        tokens: Sequence[int],
        remaining: int,
        judged: Judged,
        verified: m.Verified,
    ) -> Emitted:
        """Advance past a verdict: the tokens to emit (cut at EOS and at ``remaining``) with
        their log-probabilities from the target's rows when the request asked. The verifier
        keeps the accepted path and the bonus; a draft head gets their features (the ones
        before each emitted token) with its next draft."""
        emitted = verdict.tokens(np.asarray(tokens))
        bonus_position = self.position - 1
        self.position += len(emitted)
        emitted, stopped = cut_at_end(emitted, self.ends)
        emitted = emitted[:remaining]
        self.emitted(emitted)
        self.verifier.accepted(verdict)
        if self.drafter.features is not None:
            kept = self.verifier.kept_features(verified, self.pair.arena)
            if kept is not None:
                self.drafter.features.add(bonus_position, kept)
        logprobs = None
        if self.logprobs is not None and judged.rows is not None:
            logprobs = [
                token_logprob(judged.rows[row], token, self.logprobs)
                for row, token in zip(verdict.rows(), emitted, strict=False)
            ]
        return Emitted(emitted, stopped, logprobs)
