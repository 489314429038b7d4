"""What recomputing a prompt's tokens costs on this device: the other side of every
restore-or-recompute decision (`restore_model.RestoreModel`). No MLX here; the reasons and
figures are in docs/design/restore-or-recompute.md."""

from __future__ import annotations

from typing import Any

import numpy as np

from omlx.cache.plan.restore_plan import PrefillEstimate

SLOW_OUTLIER_WEIGHT = 0.2  # of a prefill 1.5x slower than predicted
# A fit whose attention term per token, against its per-token term, lies further than this
# factor from what the model's shapes say (`model_shapes.attention_ratio`) is not trusted:
# attention runs below the matrix multiplies' efficiency, which the span allows for; a fit
# through a few noisy prefills can be off by more (docs/design/restore-or-recompute.md).
PRIOR_SPAN = 8.0


class PrefillCost:
    """Seconds this device takes to prefill n tokens after d cached ones, fitted to the
    engine's own prefills as t ≈ c + a·n + b·n·(d + n/2) (fixed, per-token and attention
    terms) by least squares with older observations fading out; `prior` is the model's b/a."""

    TERMS = 3

    def __init__(self, decay: float = 0.9, prior: float | None = None):
        self.decay = decay
        self.prior = prior
        self._xx = [[0.0] * self.TERMS for _ in range(self.TERMS)]
        self._xt = [0.0] * self.TERMS
        self.observations = 0
        self._last_slow = False
        self._fitted: tuple[float, float, float] | None = None  # `_fit` until the sums change

    def observe(self, n: int, depth: int, seconds: float) -> None:
        if n <= 0 or seconds <= 0:
            return
        decay, weight = self.decay, 1.0
        predicted = self._predict(n, depth, whole=True)
        if predicted is not None and seconds < predicted / 2:
            # Much faster than the history says: the history was slowed by something that has
            # passed (a GPU compiling kernels for new shapes on first use), and compute is
            # never faster than the device allows, so start over from this one: an estimate
            # that is too high makes slow restores look worth it.
            decay = 0.0
        slow = predicted is not None and seconds > 1.5 * predicted
        if slow and not self._last_slow:
            # Much slower, after one that was not: most likely a one-off (a new prompt
            # shape's graphs being built), so it counts a fifth; the next slow one counts
            # fully (a lasting slowdown). Otherwise one such prefill flips the next decisions.
            weight = SLOW_OUTLIER_WEIGHT
        self._last_slow = slow
        x = (1.0, float(n), n * (depth + n / 2))
        for i in range(self.TERMS):
            self._xt[i] = decay * self._xt[i] + weight * x[i] * seconds
            for j in range(self.TERMS):
                self._xx[i][j] = decay * self._xx[i][j] + weight * x[i] * x[j]
        self.observations += 1
        self._fitted = None

    def state(self) -> dict[str, Any]:
        return {"xx": self._xx, "xt": self._xt, "observations": self.observations}

    def load(self, state: dict[str, Any]) -> None:
        xx = [[float(v) for v in row] for row in state["xx"]]
        xt = [float(v) for v in state["xt"]]
        pad = self.TERMS - len(xt)  # saved before the fixed term: its sums start at zero
        self._xx = [[0.0] * self.TERMS for _ in range(pad)] + [[0.0] * pad + row for row in xx]
        self._xt = [0.0] * pad + xt
        self.observations = int(state["observations"])
        self._fitted = None

    def seconds(self, n: int, depth: int = 0) -> float | None:
        """Predicted seconds that n tokens after `depth` add to a prefill (the fixed cost not
        included), or None before the first observation."""
        return self._predict(n, depth, whole=False)

    def _predict(self, n: int, depth: int, whole: bool) -> float | None:
        if not self.observations:
            return None
        c, a, b = self._fit()
        return (c if whole else 0.0) + a * n + b * n * (depth + n / 2)

    def estimate(self) -> PrefillEstimate:
        """The fit now, as a value a plan carries (no terms before the first observation)."""
        return PrefillEstimate(self._fit() if self.observations else None)

    def terms(self) -> tuple[float, float, float]:
        """The fitted (c, a, b) of t ≈ c + a·n + b·n·(d + n/2); zeros before any observation."""
        return self._fit() if self.observations else (0.0, 0.0, 0.0)

    def _fit(self) -> tuple[float, float, float]:
        """The fit of the current sums, made once (asked by every restore decision)."""
        if self._fitted is None:
            self._fitted = self._fit_sums()
        return self._fitted

    def _fit_sums(self) -> tuple[float, float, float]:
        """(c, a, b) of all three terms where the observations tell them apart, none negative and
        b/a within `PRIOR_SPAN` of the prior; else without the fixed term; else b = prior·a (with the
        fixed term, then without); with no prior, the per-token cost alone."""
        xx, xt, prior = self._xx, self._xt, self.prior
        for terms in ((0, 1, 2), (1, 2)):
            coef = _solve([[xx[i][j] for j in terms] for i in terms], [xt[i] for i in terms])
            if coef is None:
                continue
            fitted = dict(zip(terms, coef, strict=True))
            c, a, b = fitted.get(0, 0.0), fitted[1], fitted[2]
            if c < 0 or a <= 0 or b < 0:
                continue
            if prior is not None and not prior / PRIOR_SPAN <= b / a <= prior * PRIOR_SPAN:
                continue
            return c, a, b
        if prior is None:
            return 0.0, xt[1] / xx[1][1], 0.0
        # one feature, n + prior·n·(d + n/2): its sums follow from the ones kept
        s11 = xx[1][1] + 2 * prior * xx[1][2] + prior * prior * xx[2][2]
        s01 = xx[0][1] + prior * xx[0][2]
        t1 = xt[1] + prior * xt[2]
        coef = _solve([[xx[0][0], s01], [s01, s11]], [xt[0], t1])
        if coef is not None and coef[0] >= 0 and coef[1] > 0:
            return coef[0], coef[1], prior * coef[1]
        return 0.0, t1 / s11, prior * t1 / s11


def _solve(xx: list[list[float]], xt: list[float]) -> list[float] | None:
    """Least squares from its normal equations, scaled first (the terms' sizes differ by
    ~10^9); None where they do not tell the terms apart."""
    m, v = np.array(xx), np.array(xt)
    scale = np.sqrt(np.diag(m))
    if np.any(scale <= 0):
        return None
    normed = m / np.outer(scale, scale)
    if np.linalg.cond(normed) > 1e8:
        return None
    return (np.linalg.solve(normed, v / scale) / scale).tolist()
